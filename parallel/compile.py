"""The compile pass: each decoder layer of a built chunk compiled by torch.compile (inductor), in place; and
`train.compile=auto`'s trial, which times a compiled step against an eager one early in the run and keeps the faster.

It runs last, after the TP, EP and recompute passes, so what gets compiled is the layer those passes made (its TP
collectives, its expert dispatch, its checkpointed forward); whatever dynamo cannot trace (a collective with host
split sizes, the I/W split's deferral) stays eager behind a graph break. `nn.Module.compile` compiles the module's
call in place: the layer keeps its class, its parameters and their dense names, so checkpoints, gradient sync and
the optimizer see the same model. The layers of a model share one code path, so a chunk compiles it once (per
distinct shape), at its first forward. Turning a layer back to eager only drops its compiled call (and turning it
compiled again restores it): the same parameters and code, so the numbers stay those of eager within fp32 round-off.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallel.decoder import Decoder


def compile_mode(setting: bool | str | None, device: torch.device) -> str:
    """`train.compile` as a mode: `true` -> on, `false` -> off, `auto` -> auto; `null` (the default) is auto on CUDA,
    where compiled layers usually win, and off on a CPU, where a run would pay minutes of compiling for little."""
    if setting is None:
        return "auto" if device.type == "cuda" else "off"
    if isinstance(setting, bool):
        return "on" if setting else "off"
    if setting == "auto":
        return "auto"
    raise ValueError(f"train.compile={setting} is not supported; use true, false or auto")


def apply_compile(decoder: Decoder, mode: str) -> Decoder:
    """Compile every decoder layer of `decoder` in place unless `mode` is off (`auto` compiles too: its trial needs
    both)."""
    if mode != "off":
        for _, layer in decoder.blocks():
            layer.compile()
    return decoder


@dataclass(frozen=True)
class Choice:
    """What `train.compile=auto` measured and chose: the median step times (seconds, slowest rank) and the mode kept."""

    compiled_s: float
    eager_s: float
    compiled: bool

    def line(self) -> str:
        """The one log line that says it."""
        kept = "keeping the compiled layers" if self.compiled else "running eager from now on"
        return (f"train.compile=auto: compiled steps took {self.compiled_s:.3f} s, eager steps {self.eager_s:.3f} s "
                f"(median of {len(TRIAL) // 2} each): {kept}")


# The steps after the compiling first one: one eager step, not timed (the eager layers' first call, cold: it timed
# against warm compiled steps, a trial of 2 + 2 steps kept compiled layers 4-5% slower than eager at h768-l4 pp2 in
# two launches of two), then compiled and eager in A B B A A B B A order (a drift of the machine's speed weighs on
# both sides alike), each side's median the one compared.
WARM_UP = (False,)
TRIAL = (True, False, False, True, True, False, False, True)
STEP_MODES = (True, *WARM_UP, *TRIAL)  # every step's mode up to the choice; step 1 compiles


class CompileTrial:
    """`train.compile=auto` over this process's chunks: `after_step(seconds)` after every optimizer step turns the
    layers eager or compiled for the next step, and after the trial's last one agrees on the choice with every rank
    (one all-reduce of the step times, the maximum over ranks: the slowest rank sets a step's time) and returns it;
    afterwards it does nothing. A run shorter than len(STEP_MODES) steps ends before choosing."""

    def __init__(self, chunks: list[Decoder], device: torch.device, group: dist.ProcessGroup | None):
        # nn.Module.compile keeps the compiled call in `_compiled_call_impl`; clearing it runs the layer eager.
        self.compiled_calls: dict[nn.Module, Callable] = {
            layer: layer._compiled_call_impl for chunk in chunks for _, layer in chunk.blocks()
            if layer._compiled_call_impl is not None}
        self.device, self.group = device, group
        self.steps = 0
        self.times: list[float] = []  # the trial's steps, in TRIAL's order
        self.choice: Choice | None = None

    def use(self, compiled: bool) -> None:
        """Run the layers compiled or eager from their next call on."""
        for layer, call in self.compiled_calls.items():
            layer._compiled_call_impl = call if compiled else None

    def after_step(self, seconds: float) -> Choice | None:
        """Count the step that took `seconds`; the choice, once, after the trial's last step."""
        if self.choice is not None:
            return None
        if self.steps > len(WARM_UP):
            self.times.append(seconds)
        self.steps += 1
        if self.steps < len(STEP_MODES):
            self.use(STEP_MODES[self.steps])
            return None
        spent = torch.tensor(self.times, dtype=torch.float64, device=self.device)
        if self.group is not None:
            dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=self.group)
        by_mode = {mode: [t for t, m in zip(spent.tolist(), TRIAL) if m == mode] for mode in (True, False)}
        compiled_s, eager_s = statistics.median(by_mode[True]), statistics.median(by_mode[False])
        self.choice = Choice(compiled_s, eager_s, compiled_s < eager_s)
        self.use(self.choice.compiled)
        return self.choice
