"""LoRA: low-rank adapters on a built decoder chunk's linears, every other weight frozen.

A chunk pass (`parallel.passes`) the trainer adds to the engine's list: it runs on each pruned chunk after the TP and
EP passes (and before recompute and compile), so it sees the linears TP made. A targeted linear keeps its class, its
dense name and its weight; it gains two children, `lora_A` [rank, in] and `lora_B` [out, rank] (PEFT's names:
`model.layers.0.self_attn.q_proj.lora_A.weight`), and a branch `lora_B(lora_A(dropout(x))) * alpha / rank` that the
linear adds to its output (`parallel.tensor.add_branch`: the TP layers carry it through their own collectives, so
their forwards are not restated here). lora_A starts normal(0, 0.02), drawn per dense name from the seed, and lora_B
at zero (MiniMind's train_lora), so step 0 computes the base model; with `lora.init` both start from a file (MiniMind's
LoRA .pth or a PEFT folder, `checkpoint.adapters`), so step 0 computes where that file's run ended.

TP slices an adapter the way its base linear is sliced. A colwise linear (output rows split, input replicated):
lora_A whole, lora_B split by rows; the rank-sized activation enters the TP region, so its gradient is summed over TP
and lora_A's gradient is whole on every rank. A rowwise linear (input columns split, output summed): lora_A split by
columns, lora_B whole; the base's partial output and the adapter's partial rank-sized activation travel in the one
all-reduce the base makes, and lora_B applies to the summed activation, so the adapter output is added once.

Adapters get their initial values when made (on the compute device beside a meta base), so materialising fills only
the base weights from the weight source. The frozen base weights are out of every gradient path but the input's: no
`.grad`, no bucket, no optimizer state. Under the I/W split the adapters' `F.linear`s are trainable and take the
split like any other; a frozen weight's linear computes its input gradient only.
"""

import fnmatch
import re
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from checkpoint.adapters import read_lora_init
from checkpoint.errors import CheckpointError
from checkpoint.lora_merge import ADAPTERS
from parallel.decoder import Decoder
from parallel.expert import is_expert
from parallel.grid import ParallelGrid
from parallel.materialize import dense_shape
from parallel.passes import Site
from parallel.tensor import ColumnParallelLinear, RowParallelLinear, add_branch
from parallel.tensor_pass import local_block, plan_pattern

LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
INIT_STD = 0.02  # lora_A's initial standard deviation (MiniMind's train_lora)
FIX_TARGETS = "set lora.targets to the linears the file adapts (those of the run that saved it)"


@dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on the decoder layers' linears (the run config's `lora.*`); rank 0 = off."""

    rank: int = 0
    alpha: float | None = None  # the adapters' output is scaled by alpha / rank; None: alpha = rank (scale 1)
    targets: tuple[str, ...] | None = None  # linear-name patterns; None: every square linear (MiniMind's choice)
    dropout: float = 0.0  # on the adapters' input only
    seed: int = 0  # lora_A's initial values are drawn per dense name from it (the same in every layout)
    init: str | None = None  # a MiniMind LoRA .pth or PEFT folder whose adapters the run starts from instead

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def __call__(self, chunk: Decoder, site: Site) -> Decoder:
        """The chunk pass: `apply_lora` on a chunk where it runs."""
        return apply_lora(chunk, self, site.grid)


def layer_linears(decoder: Decoder) -> list[tuple[str, nn.Module]]:
    """(dense name, module) of every linear of the decoder's layers (adapters excluded)."""
    prefix = decoder.plan.stack + "."
    return [(n, m) for n, m in decoder.module.named_modules()
            if n.startswith(prefix) and isinstance(m, LINEARS) and n.rpartition(".")[2] not in ADAPTERS]


def matches(pattern: str, name: str) -> bool:
    """A dotted pattern (`*` and shell wildcards within one component) matches the end of `name` (PEFT's suffix rule:
    `q_proj` matches `model.layers.0.self_attn.q_proj`)."""
    want, have = pattern.split("."), name.split(".")
    return len(want) <= len(have) and all(fnmatch.fnmatchcase(h, w) for w, h in zip(want, have[-len(want):]))


def targeted(name: str, module: nn.Module, spec: LoraSpec, tp: int = 1) -> bool:
    """Whether `spec` puts an adapter on the linear `name`: a pattern matches it, or (no patterns) it is square."""
    if spec.targets is None:
        out_features, in_features = dense_shape(module.weight, tp)
        return out_features == in_features
    return any(matches(pattern, name) for pattern in spec.targets)


def lora_targets(decoder: Decoder, spec: LoraSpec) -> list[str]:
    """The dense names of the whole model's linears that `spec` adapts; ValueError naming the patterns and the
    linears there are when none is (the pre-launch check)."""
    linears = layer_linears(decoder)
    found = [name for name, module in linears if targeted(name, module, spec)]
    if found or not spec.enabled:
        return found
    kinds = {re.sub(r"\.\d+\.", ".*.", name.removeprefix(decoder.plan.stack + ".").split(".", 1)[1]):
             "x".join(map(str, reversed(module.weight.shape))) for name, module in linears}
    there = ", ".join(f"{kind} ({shape})" for kind, shape in kinds.items())
    if spec.targets is None:
        raise ValueError(f"lora.targets=null adapts the square linears (in == out) of the decoder layers, and this "
                         f"model has none; name some in lora.targets (its linears, in x out: {there})")
    raise ValueError(f"lora.targets={list(spec.targets)} matches no linear of the decoder layers; name some of "
                     f"them (a pattern matches a name's end, `*` one component): {there}")


def initial_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The dense initial value of adapter weight `name`: lora_A normal(0, 0.02) from a generator seeded by (seed,
    name), lora_B zeros; the same whatever part of the model a rank builds."""
    if name.endswith(".lora_B.weight"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * INIT_STD


def _targets_text(spec: LoraSpec) -> str:
    return f"lora.targets={list(spec.targets)}" if spec.targets is not None else "lora.targets=null (square linears)"


def file_adapters(spec: LoraSpec, shapes: dict[str, tuple[int, int]], targets: set[str],
                  whole: bool) -> dict[str, torch.Tensor]:
    """The dense initial adapter weights lora.init holds for `targets`, linears among `shapes` (dense name -> (out,
    in)); CheckpointError naming the first linear where the file and the run disagree. A pair of zeros counts as none
    (MiniMind's padded export writes one for each square linear not adapted). `whole`: `shapes` is every linear of the
    model's layers, so a pair naming none of them is refused too (a chunk sees only its own layers)."""
    weights = read_lora_init(spec.init, spec.rank, spec.scale)
    key, a, b = f"lora.init={spec.init}", ".lora_A.weight", ".lora_B.weight"
    live = {n[:-len(a)] for n, t in weights.items() if n.endswith(a) and (t.any() or weights[n[:-len(a)] + b].any())}
    for name in sorted(live - targets):
        if name in shapes:
            raise CheckpointError(f"{key}: it holds adapters for {name}, which {_targets_text(spec)} does not adapt; "
                                  f"{FIX_TARGETS}")
        if whole:
            raise CheckpointError(f"{key}: it holds adapters for {name}, not a linear of this model's decoder layers; "
                                  "give adapters trained on this model")
    for name in sorted(targets):
        if name not in live:
            raise CheckpointError(f"{key}: it holds no adapters for {name}, which {_targets_text(spec)} adapts; "
                                  f"{FIX_TARGETS}")
        out_features, in_features = shapes[name]
        have_in, have_out = weights[name + a].shape[1], weights[name + b].shape[0]
        if (have_out, have_in) != (out_features, in_features):
            raise CheckpointError(f"{key}: its adapters of {name} are {have_in}x{have_out} (in x out) but the linear "
                                  f"is {in_features}x{out_features}; give adapters trained on this model")
    return {n: t for n, t in weights.items() if n.rpartition(".")[0].rpartition(".")[0] in targets}


def apply_lora(decoder: Decoder, spec: LoraSpec, grid: ParallelGrid) -> Decoder:
    """Freeze every parameter of `decoder` (a chunk, after TP and EP) and give each targeted linear its adapters, their
    initial values drawn or (lora.init) read from the file, once per chunk. A chunk may hold no target (the patterns
    name another stage's layers): it then trains nothing itself."""
    if not spec.enabled:
        return decoder
    styles = [(plan_pattern(key), style) for key, style in decoder.plan.tp_plan.items()]
    linears = layer_linears(decoder)
    targets = [(n, m) for n, m in linears if targeted(n, m, spec, grid.tp)]
    initial = None
    if spec.init is not None:
        shapes = {n: dense_shape(m.weight, grid.tp) for n, m in linears}
        initial = file_adapters(spec, shapes, {n for n, _ in targets}, whole=False)
    for param in decoder.module.parameters():
        param.requires_grad_(False)
    for name, linear in targets:
        style = next((s for pattern, s in styles if pattern.fullmatch(name)), None)
        if grid.tp > 1 and style == "replicated_with_grad_allreduce":
            raise ValueError(f"lora.targets: {name} is TP-replicated with a partial gradient; LoRA adapts colwise, "
                             "rowwise and whole linears: leave it out of lora.targets")
        _adapt(name, linear, spec, grid, initial)
    return decoder


def _adapt(name: str, linear: nn.Module, spec: LoraSpec, grid: ParallelGrid,
           initial: dict[str, torch.Tensor] | None) -> None:
    """Give one linear its adapters (from `initial`, else drawn), sliced as TP slices it, and the branch adding them."""
    out_features, in_features = dense_shape(linear.weight, grid.tp)
    row, col = isinstance(linear, RowParallelLinear), isinstance(linear, ColumnParallelLinear)
    for child, shape, dim in (("lora_A", (spec.rank, in_features), 1 if row else None),
                              ("lora_B", (out_features, spec.rank), 0 if col else None)):
        weight_name = f"{name}.{child}.weight"
        dense = initial[weight_name] if initial is not None else initial_adapter(weight_name, shape, spec.seed)
        weight = _adapter_weight(dense, dim, linear.weight, grid)
        holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        holder.weight = weight
        setattr(linear, child, holder)
    add_branch(linear, LowRank(linear, spec.scale, spec.dropout))


def _adapter_weight(dense: torch.Tensor, dim: int | None, base: nn.Parameter, grid: ParallelGrid) -> nn.Parameter:
    """This rank's block of one adapter weight, from its dense initial value (on the compute device beside a meta base:
    no weight source holds it); TP-marked when sliced (lora_B by its base's packed parts: Phi-3's [q | k | v] rows),
    EP-marked beside an EP-split expert."""
    packed = getattr(base, "tp_packed", 1) if dim == 0 else 1
    tensor = local_block(dense, grid.tp_rank, grid.tp, dim, packed) if dim is not None else dense
    device = grid.device if base.is_meta else base.device
    weight = nn.Parameter(tensor.to(device=device, dtype=base.dtype, copy=tensor is not dense).contiguous())
    if dim is not None:
        weight.tensor_parallel, weight.partition_dim = True, dim
        if packed != 1:
            weight.tp_packed = packed
    if is_expert(base):
        weight.expert_parallel = True
    return weight


class LowRank:
    """An adapted linear's branch: lora_A on the (dropped-out) input, lora_B on what the linear's collective made of
    it, scaled (a class, not a closure, so deepcopy rebinds it)."""

    def __init__(self, linear: nn.Module, scale: float, dropout: float):
        self.linear, self.scale, self.dropout = linear, scale, dropout

    def down(self, x: torch.Tensor) -> torch.Tensor:
        m = self.linear
        return F.linear(F.dropout(x, self.dropout, m.training) if self.dropout else x, m.lora_A.weight)

    def up(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.linear.lora_B.weight) * self.scale
