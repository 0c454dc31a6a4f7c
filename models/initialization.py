"""A family's own initialisation, one tensor at a time: its class's `_init_weights`, run on a shell of one module.

transformers initialises a model module by module (`_init_weights(module)`): normal weights, ones or zeros for norms
(Gemma's norms are zero-centred), a zero padding row, rotary tables and scales. Sluice builds the model on the meta
device and fills each parameter on its own (seeded by its name, so that every layout starts from the same weights),
so it runs that same method on a shallow copy of the parameter's module in which only that parameter is real.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from parallel.decoder import ContractError

InitWeights = Callable[[nn.Module], None]  # a PreTrainedModel's `_init_weights`, bound to its model


def _shell(module: nn.Module, real: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of `module` whose parameters are meta placeholders except `real` (its buffers and children
    shared): whatever `_init_weights` writes lands in `real` or in the module's own buffers, nowhere else."""
    shell = copy.copy(module)
    shell.__dict__["_parameters"] = {key: real.get(key, None if p is None else torch.empty_like(p, device="meta"))
                                     for key, p in module._parameters.items()}
    return shell


def init_parameter(init_weights: InitWeights, owner: nn.Module, name: str, shape: tuple[int, ...],
                   generator: torch.Generator) -> torch.Tensor:
    """The initial value of parameter `name` (of module `owner`, at dense `shape`) by the family's `_init_weights`,
    drawing from `generator` (as if it were the global generator): ContractError where the method leaves it unset."""
    leaf = name.rpartition(".")[2]
    tensor = torch.full(shape, float("nan"))
    shell = _shell(owner, {leaf: tensor})
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.set_state(generator.get_state())
        init_weights(shell)
    if torch.isnan(tensor).any():
        raise ContractError(f"{name}: {type(owner).__name__} is not initialised by its model's _init_weights; "
                            "give the family's adapter an init_tensor rule for it")
    return tensor


def init_module_buffers(init_weights: InitWeights, module: nn.Module) -> None:
    """Recompute the buffers of every submodule of `module` that owns some, by the family's `_init_weights` (its
    parameters untouched: the shell holds meta placeholders for them)."""
    for sub in module.modules():
        if any(b is not None for b in sub._buffers.values()):
            with torch.no_grad():
                init_weights(_shell(sub, {}))
