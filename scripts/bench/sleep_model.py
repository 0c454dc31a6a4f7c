"""A MiniMind whose decoder layers cost a fixed time without using the CPU: F, I and W each sleep.

Each `SleepLayer` computes `x + x @ 0 + linear(ones, W)` (an identity, so the numbers stay finite) where
- the forward sleeps `f` seconds and the input-gradient backward sleeps `i` (`_SleepInput`);
- the weight gradient of `W` sleeps `w`, wherever a framework computes it: in its own autograd node
  (`_SleepWeight`: torch's B, and torch's zero-bubble W, which re-runs only the nodes that lead to weights),
  or in Sluice's split backward, which routes `F.linear` on a Parameter through its own function and
  computes the weight gradient with `mm` on the saved input (`_SleepOnes.mm` sleeps there).
So B costs i + w under both frameworks, and I / W cost i / w where a schedule splits them.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from minimind import MiniMindConfig, MiniMindForCausalLM
from parallel.pipeline.actions import Costs
from parallel.pipeline.partition import layer_partition
from models import decoder_of
from parallel.step import MicroBatch
from training.objectives.lm import shifted_loss_sum


class _SleepInput(torch.autograd.Function):
    """Identity that sleeps `f` in forward and `i` in backward (the input-gradient path)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f: float, i: float) -> torch.Tensor:
        time.sleep(f)
        ctx.i = i
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.i)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """linear(ones, weight) whose weight gradient sleeps `w` (never on the input path: ones need no grad)."""

    @staticmethod
    def forward(ctx, ones: torch.Tensor, weight: torch.Tensor, w: float) -> torch.Tensor:
        ctx.save_for_backward(ones)
        ctx.w = w
        return F.linear(ones, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ones,) = ctx.saved_tensors
        time.sleep(ctx.w)
        flat = grad.reshape(-1, grad.shape[-1])
        return None, flat.t().mm(ones.reshape(-1, ones.shape[-1])), None


class _SleepOnes(torch.Tensor):
    """The constant input of the weight path; `F.linear` on it goes through `_SleepWeight`, and an `mm` with
    it (Sluice's deferred weight gradient) sleeps `w`. Views and casts keep the class so W still sees it."""

    w: float = 0.0
    KEEP = {torch.Tensor.to, torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.detach, torch.Tensor.contiguous}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            ones, weight = args[0], args[1]
            return _SleepWeight.apply(ones.as_subclass(torch.Tensor), weight, _w_of(ones))
        if func in (torch.Tensor.mm, torch.mm):
            time.sleep(max(_w_of(a) for a in args))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in cls.KEEP and isinstance(out, torch.Tensor):
            out = out.as_subclass(cls)
            out.w = _w_of(args[0])
        return out


def _w_of(value: object) -> float:
    return value.w if isinstance(value, _SleepOnes) else 0.0


class SleepLayer(nn.Module):
    """Stands in for a DecoderLayer (same call signature): identity output, fixed sleep per pass."""

    def __init__(self, hidden: int, f: float, i: float, w: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden, 1))
        self.f, self.i, self.w = f, i, w

    def forward(self, x: torch.Tensor, cos, sin, mask=None, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        ones = torch.ones(1, 1, 1).as_subclass(_SleepOnes)
        ones.w = self.w
        x = _SleepInput.apply(x, self.f, self.i)
        return x + F.linear(ones, self.weight), x.new_zeros(())


def sleep_model(n_layers: int, hidden: int, vocab: int, f: float, i: float, w: float) -> MiniMindForCausalLM:
    """A tiny MiniMind (untied embeddings, so no cross-stage gradient sum) with every layer a SleepLayer."""
    config = MiniMindConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=hidden, max_position_embeddings=1024,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config)
    for key in list(model.model.layers.keys()):
        model.model.layers[key] = SleepLayer(hidden, f, i, w)
    return model


def stage_costs_alone(model: MiniMindForCausalLM, n_stages: int, batch: MicroBatch, repeats: int = 10) -> Costs:
    """Each stage's F and B timed alone in this process with plain autograd (no pipeline runtime of either
    framework): what a stage action costs here, sleep plus the model code around it. B splits into I and W
    as its sleeps do (i and w are equal in this benchmark). Medians over `repeats` after two warm-ups."""
    partition = layer_partition(model.config.num_hidden_layers, n_stages)
    hidden = model.config.hidden_size
    f_s, b_s = [], []
    for s in range(n_stages):
        first, last = s == 0, s == n_stages - 1
        chunk = decoder_of(model).prune(partition[s], first, last)
        shape = (*batch.input_ids.shape, hidden)
        grad = torch.ones(shape) if not last else None
        times: list[tuple[float, float]] = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            if first:
                out, _ = chunk(input_ids=batch.input_ids)
            else:
                out, _ = chunk(hidden=torch.zeros(shape, requires_grad=True))
            if last:  # the chunk's output is the logits
                out = shifted_loss_sum(out, batch.labels)
            middle = time.perf_counter()
            out.backward(grad)
            times.append((middle - start, time.perf_counter() - middle))
        f_s.append(statistics.median(t[0] for t in times[2:]))
        b_s.append(statistics.median(t[1] for t in times[2:]))
    halves = tuple(b / 2 for b in b_s)
    return Costs(f=statistics.fmean(f_s), b=statistics.fmean(b_s), i=statistics.fmean(halves),
                 w=statistics.fmean(halves), stage_f=tuple(f_s), stage_b=tuple(b_s), stage_i=halves, stage_w=halves)
