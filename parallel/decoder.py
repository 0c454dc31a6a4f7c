"""The contract between a model and the parallel layer: the pieces a decoder declares, plus its family's adapter.

transformers declares how a causal LM splits, on its own classes: the config's `base_model_pp_plan` (the input
embedding, the layer stack and the final pieces, in order, with their inputs and outputs), the LM class's
`_pp_plan` (the head), `base_model_tp_plan` / `_tp_plan` (how each piece shards), `base_model_ep_plan` (which
module holds a layer's experts) and `_tied_weights_keys`.
`DecoderPlan` reads them once; every pass of this package finds a model's pieces through it and names none itself.
What a plan cannot say lives in one small `FamilyAdapter` per model family (`models/`); `Decoder` runs a whole
model or a pipeline chunk of it piece by piece with the two.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


class ContractError(ValueError):
    """A model that does not declare what the parallel layer needs; the message names it and what is missing."""


@dataclass(frozen=True)
class DecodeContext:
    """What a forward over a cache needs beside positions: the 2D padding mask over past and new tokens (None: no
    padding), the family's cache object, and the chunk's global layer ids (a pipeline stage's cache fills only its
    own layers, so the past is read from one of them)."""

    attention_mask: torch.Tensor | None
    cache: Any
    layer_ids: tuple[int, ...]


class FamilyAdapter(Protocol):
    """What a declared plan cannot say about one model family (one small implementation per family)."""

    def embed(self, base: nn.Module, embedding: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> the first layer's input. The plan names the embedding; a family may do more on the way
        (MiniMind's embedding dropout)."""

    def layer_inputs(self, base: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                     context: DecodeContext | None = None) -> dict[str, Any]:
        """What every layer receives beside the hidden states (rotary tables, attention masks), made once per
        chunk and micro-batch: the plan names the layer stack's inputs, not how they are made. With `context`
        (generation) the mask covers its cache's past and padding, and the layers write to its cache."""

    def new_cache(self) -> Any:
        """An empty key/value cache of the family's own kind (one per stage and micro-batch of sequences): the
        layers of a chunk write to it under their global layer ids."""

    def run_layer(self, layer_id: int, layer: nn.Module, hidden: torch.Tensor,
                  inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer -> (hidden states, its aux loss or None): calling conventions differ (positional tables, a
        returned tuple), and an MoE router's loss may come back as a second output or only through a hook."""

    def init_tensor(self, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """The family's initial value of the dense parameter `name`, drawn from `generator`: a rank then builds
        only its own parameters, each seeded by its name, and every layout starts from the same weights."""

    def init_buffers(self, module: nn.Module) -> None:
        """Compute every buffer (rotary tables, scales) of a module materialised from the meta device, whose
        buffers read NaN until then: they are computed, never stored, so no weight source holds them; one left
        NaN is refused."""

    def tp_module(self, dense: nn.Module, parallel: nn.Module) -> nn.Module | None:
        """The TP module standing for `dense`, a subclass of nn.Linear / nn.Embedding with behaviour of its own
        (Gemma3's scaled embedding), built from `parallel` (the plain TP layer of its shard) so as to keep that
        behaviour; None where the family has no such module (the TP pass then refuses it)."""

    def tp_plan(self, declared: dict[str, str]) -> dict[str, str]:
        """The base model's TP plan this family runs, given the one its config declares (`base_model_tp_plan`):
        the declared one, or a better one of the same styles (Phi-3 splits its fused projections by heads where
        transformers gathers them). Reads no model: the registry checks its styles at import."""

    def tp_parts(self, name: str) -> tuple[int, ...] | None:
        """The dense sizes of the parts packed side by side along the sharded dim of the planned module or
        parameter `name` under a packed style (Phi-3's [q | k | v] rows, unequal under GQA); None: equal halves,
        as transformers packs [gate | up]."""

    def tp_local(self, layer: nn.Module, tp: int) -> None:
        """After the TP pass shards `layer` (tp >= 2): make a forward that reads global sizes (Phi-3's attention,
        slicing its packed q, k, v at the config's head counts) read this rank's; a no-op for most families."""

    def selective_recompute(self, layer: nn.Module) -> list[Any]:
        """The blocks of one layer that `train.recompute=selective` recomputes (`parallel.recompute` targets) by
        role (an attention core, an MLP's activation), and an `UnknownRole` for a part whose role the family cannot
        name (left saved; the run says so at start): which part is cheap to redo and heavy to keep is a property of
        the architecture, not of a plan."""

    def moe_forward(self, block: nn.Module, experts: Callable) -> Callable | None:
        """The forward of an MoE `block` that routes as the model does and hands its experts to
        `experts(tokens, top_k_index, top_k_weights)` (the EP pass's dispatcher), or None where the family's
        experts module already has that signature (transformers' own)."""

    def expert_choices(self, block: nn.Module) -> tuple[nn.Module, Callable[[Any], torch.Tensor]]:
        """The router of an MoE `block` and how its forward output gives the experts each token goes to
        ([tokens, top_k] global expert ids): the tokens-per-expert metric reads them with a forward hook."""

    def tp_sizes(self) -> dict[str, int]:
        """Config sizes tensor parallelism splits (heads, widths, experts' widths, vocabulary), by config key:
        a size TP does not divide is refused before launch, naming the key."""

    def matmul_params_per_token(self) -> int:
        """Weights one token multiplies with (routed experts counted top-k times): FLOPs, MFU, the layout search."""

    def saved_bytes_per_layer(self, micro_batch_size: int, seq_len: int, dtype_bytes: int, mode: str,
                              tp: int = 1) -> int | None:
        """Bytes one layer saves for backward per micro-batch on a TP rank, or None where the family has no
        closed formula (the layout search then measures)."""


@dataclass(frozen=True)
class DecoderPlan:
    """Where a causal LM's pieces are (dense module names) and how they shard, read from its declared plans."""

    base: str  # the base model under the LM class
    embedding: str  # token ids -> hidden states (first stage only)
    stack: str  # the layer stack, split between stages by global layer id
    finals: tuple[str, ...]  # after the layers, in order (last stage only)
    head: str  # hidden states -> logits (last stage only)
    tp_plan: dict[str, str]  # module or parameter name pattern -> TP style
    ties: dict[str, str]  # a tied parameter -> the parameter it equals (empty when untied)
    ep_plan: dict[str, str] = field(default_factory=dict)  # module or parameter name pattern -> EP style

    @staticmethod
    def of(model: nn.Module, adapter: FamilyAdapter | None = None) -> DecoderPlan:
        """Read the plans `model`'s classes declare (the TP plan through the family `adapter`'s `tp_plan`, where
        given); ContractError naming the class when one is missing."""
        name = type(model).__name__
        pp_plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
        head_plan = dict(getattr(type(model), "_pp_plan", None) or {})
        base = getattr(model, "base_model_prefix", "")
        if not pp_plan or not head_plan or not base or not hasattr(model, base):
            raise ContractError(f"{name} declares no pipeline plan (base_model_pp_plan on its config, _pp_plan on "
                                "the model class, a base_model_prefix): Sluice cannot split it into stages")
        root = model.get_submodule(base)
        stacks = [key for key in pp_plan if isinstance(root.get_submodule(key), (nn.ModuleList, nn.ModuleDict))]
        if len(stacks) != 1:
            raise ContractError(f"{name}: its base_model_pp_plan names {len(stacks)} layer lists "
                                f"({', '.join(stacks) or 'none'}); Sluice splits exactly one")
        keys = list(pp_plan)
        before, after = keys[:keys.index(stacks[0])], keys[keys.index(stacks[0]) + 1:]
        if len(before) != 1 or list(pp_plan[before[0]][0]) != ["input_ids"] or len(head_plan) != 1:
            raise ContractError(f"{name}: its pipeline plan needs one embedding of input_ids before the layers "
                                "and one head; it declares " + ", ".join([*keys, *head_plan]))
        embedding, head = f"{base}.{before[0]}", next(iter(head_plan))
        tie = bool(getattr(model.config, "tie_word_embeddings", False))
        ties = dict(_tied_keys(model)) if tie else {}
        ep_plan = {f"{base}.{key}": style for key, style in
                   (getattr(model.config, "base_model_ep_plan", None) or {}).items()}
        return DecoderPlan(base, embedding, f"{base}.{stacks[0]}", tuple(f"{base}.{k}" for k in after), head,
                           _tp_plan(model, base, embedding, head, adapter), ties, ep_plan)

    def piece_of(self, name: str) -> tuple[str, int | None]:
        """Which piece holds the dense parameter `name`: ("embedding" | "layer" | "final" | "head", layer id)."""
        if name.startswith(self.stack + "."):
            return "layer", int(name[len(self.stack) + 1:].split(".", 1)[0])
        if name.startswith(self.embedding + "."):
            return "embedding", None
        if name.startswith(self.head + "."):
            return "head", None
        return "final", None


def _tied_keys(model: nn.Module) -> dict[str, str]:
    """transformers' `_tied_weights_keys`: {tied parameter: its source} (a list of targets in older classes)."""
    declared = getattr(type(model), "_tied_weights_keys", None) or {}
    if not isinstance(declared, dict):
        raise ContractError(f"{type(model).__name__} lists its tied weights without their source ({declared}); "
                            "declare _tied_weights_keys as {tied: source}, as transformers' own classes do")
    return dict(declared)


def _tp_plan(model: nn.Module, base: str, embedding: str, head: str,
             adapter: FamilyAdapter | None = None) -> dict[str, str]:
    """The base plan (the adapter's, prefixed) and the head's, logits left vocab-sharded; an embedding the plan
    leaves out is vocab-parallel, as in Megatron-LM, so that a tied head and embedding stay one sharded tensor."""
    declared = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    chosen = adapter.tp_plan(declared) if adapter is not None else declared
    plan = {f"{base}.{key}": style for key, style in chosen.items()}
    plan.setdefault(embedding, "embedding_rowwise")
    # The loss is vocab-parallel cross-entropy, which never gathers the logits.
    head_plan = getattr(type(model), "_tp_plan", None) or {}
    plan.update({key: "colwise" if style == "colwise_gather_output" else style for key, style in head_plan.items()})
    if head not in plan:
        plan[head] = "colwise"
    return plan


def submodule(module: nn.Module, name: str) -> nn.Module | None:
    """The submodule at dotted `name`, or None where a pruned chunk dropped it (or any parent)."""
    for part in name.split("."):
        module = module._modules.get(part) if module is not None else None
    return module


def set_submodule(module: nn.Module, name: str, value: nn.Module | None) -> None:
    """Put `value` (None: drop the piece) at dotted `name`."""
    parent, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, value)


def set_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    """Make `value` the parameter at dotted `name` (re-tying two copies into one Parameter)."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, value)


def layer_items(stack: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """(global layer id, layer) in order: a ModuleList counts from 0, a pruned ModuleDict keeps its ids."""
    if isinstance(stack, nn.ModuleDict):
        return ((int(key), layer) for key, layer in stack.items())
    return enumerate(stack)


class Decoder:
    """A causal LM, whole or one pipeline chunk of it, run piece by piece as its plan declares."""

    def __init__(self, module: nn.Module, plan: DecoderPlan, adapter: FamilyAdapter):
        self.module, self.plan, self.adapter = module, plan, adapter

    @property
    def config(self):
        return self.module.config

    @property
    def has_head(self) -> bool:
        return submodule(self.module, self.plan.head) is not None

    def blocks(self) -> list[tuple[int, nn.Module]]:
        """The layers this module holds, by global id, in order."""
        stack = submodule(self.module, self.plan.stack)
        return list(layer_items(stack)) if stack is not None else []

    def parameter(self, name: str) -> nn.Parameter | None:
        """The parameter at dense `name`, or None where this chunk does not hold it."""
        owner, _, leaf = name.rpartition(".")
        module = submodule(self.module, owner)
        return None if module is None else module._parameters.get(leaf)

    def prune(self, kept: range, first: bool, last: bool) -> Decoder:
        """A deep copy keeping the layers whose ids are in `kept`, the embedding on the first chunk and the final
        pieces and head on the last; every kept parameter keeps its dense name (a ModuleList becomes a ModuleDict
        keyed by global id)."""
        module = copy.deepcopy(self.module)
        stack = submodule(module, self.plan.stack)
        set_submodule(module, self.plan.stack,
                      nn.ModuleDict({str(i): layer for i, layer in layer_items(stack) if i in kept}))
        if not first:
            set_submodule(module, self.plan.embedding, None)
        if not last:
            for name in (*self.plan.finals, self.plan.head):
                set_submodule(module, name, None)
        return Decoder(module, self.plan, self.adapter)

    def __call__(self, input_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, cache: Any = None, attention_mask: torch.Tensor | None = None,
                 logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This chunk on token ids (first chunk) or hidden states -> (hidden states or logits, aux loss sum).

        Generation passes `positions` [B, S], the family's `cache` (from `adapter.new_cache()`), the 2D padding
        `attention_mask` over past and new tokens (None: no padding) and `logits_to_keep` (the head sees only the
        last positions, as transformers' `generate` asks)."""
        plan, adapter = self.plan, self.adapter
        base = self.module.get_submodule(plan.base)
        if input_ids is not None:
            hidden = adapter.embed(base, self.module.get_submodule(plan.embedding), input_ids)
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        blocks = self.blocks()
        if cache is None and attention_mask is None:
            inputs = adapter.layer_inputs(base, hidden, positions)
        else:
            context = DecodeContext(attention_mask, cache, tuple(i for i, _ in blocks))
            inputs = adapter.layer_inputs(base, hidden, positions, context)
        aux = hidden.new_zeros((), dtype=torch.float32)
        for layer_id, layer in blocks:
            hidden, layer_aux = adapter.run_layer(layer_id, layer, hidden, inputs)
            if layer_aux is not None:
                aux = aux + layer_aux
        head = submodule(self.module, plan.head)
        if head is None:
            return hidden, aux
        for name in plan.finals:
            hidden = self.module.get_submodule(name)(hidden)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return head(hidden), aux
