"""Generation's plain data (Sampling in, Rollout out) and one micro-batch of sequences as one stage sees it.

The one-process loop (`LocalEngine.generate`) and every pipeline stage of a generation schedule step the same
`Sequences`: positions and the padding mask as transformers' `generate` makes them for left-padded prompts, the
family's key/value cache, and on the stage with the head the sampled tokens. Sampling draws each (row, step) from
its own generator, seeded by (seed, global row id, step), so any layout and any split into micro-batches picks the
same tokens from the same logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

VocabGather = Callable[[torch.Tensor], torch.Tensor]  # this rank's logits [b, V / tp] -> the full [b, V]


@dataclass(frozen=True)
class Sampling:
    """How the last stage picks a token."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 -> greedy (argmax)
    top_p: float = 1.0
    eos_token_id: int | None = None
    pad_token_id: int = 0
    seed: int = 0  # sampling RNG: same seed -> same tokens in every layout


@dataclass
class Rollout:
    """Prompts and their completions, with what a policy-gradient step needs of them (CPU tensors)."""

    tokens: torch.Tensor  # [B, P + N] long: the left-padded prompts then the completions; after EOS: pad
    prompt_mask: torch.Tensor  # [B, P] bool: real prompt tokens (False on left padding)
    completion_mask: torch.Tensor  # [B, N] bool: generated tokens up to and including EOS
    log_probs: torch.Tensor  # [B, N] float32: log-softmax of the raw logits at each generated token, 0 where masked


def _row_seed(seed: int, row: int, step: int) -> int:
    """A 63-bit seed for one (row, step), the same in every process (no Python hash randomisation)."""
    mixed = (seed * 0x9E3779B97F4A7C15) ^ (row * 0xBF58476D1CE4E5B9) ^ (step * 0x94D049BB133111EB)
    return mixed & 0x7FFFFFFFFFFFFFFF


def pick(logits: torch.Tensor, sampling: Sampling, rows: Sequence[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [b] from full-vocabulary logits [b, V] of `rows` (global ids) at generation `step`, and their
    log-probabilities under the raw (temperature 1) logits, float32."""
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)  # as transformers' greedy search: the first of equal maxima
    else:
        scores = TemperatureLogitsWarper(sampling.temperature)(None, logits)
        if sampling.top_p < 1.0:
            scores = TopPLogitsWarper(sampling.top_p)(None, scores)
        # Gumbel-max: argmax(scores + Gumbel noise) samples softmax(scores); the noise of a row comes from its own
        # generator, so the token does not depend on which rows share a micro-batch, a rank or a process.
        noise = torch.stack([torch.rand(logits.shape[-1], device=logits.device, generator=torch.Generator(
            logits.device).manual_seed(_row_seed(sampling.seed, row, step))) for row in rows])
        gumbel = -torch.log(-torch.log(noise.clamp(min=torch.finfo(torch.float32).tiny)))
        tokens = (scores + gumbel).argmax(dim=-1)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, log_probs


def prompt_positions(prompt_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded prompts as transformers' `generate` makes them: count real tokens, padding 0."""
    return (prompt_mask.long().cumsum(-1) - 1).masked_fill(~prompt_mask, 0)


@dataclass
class Sequences:
    """One micro-batch of sequences on one stage: its cache, how many tokens it holds, and (last stage) what was
    sampled. Every stage derives positions and the padding mask from the prompt mask alone, so only hidden states
    and tokens travel between stages."""

    prompt_mask: torch.Tensor  # [b, P] bool
    rows: list[int]  # global row ids: the sampling seeds
    cache: Any  # the family's key/value cache of this stage's layers
    seen: int = 0  # tokens the cache holds
    finished: torch.Tensor | None = None  # [b] bool: emitted EOS (last stage)
    tokens: list[torch.Tensor] = field(default_factory=list)  # per step [b] long (last stage)
    log_probs: list[torch.Tensor] = field(default_factory=list)  # per step [b] float32 (last stage)

    def forward_args(self, width: int) -> dict[str, Any]:
        """Positions, padding mask (None without padding, as `generate` drops an all-ones mask) and cache of the
        next `width` tokens: the whole prompt first, then one token at a time."""
        mask = self.prompt_mask
        if self.seen == 0:
            positions = prompt_positions(mask)
        else:  # one past the row's last position (its real prompt tokens - 1, plus the tokens generated since)
            steps = torch.arange(width, device=mask.device)
            positions = mask.sum(-1, keepdim=True) + (self.seen - mask.shape[1]) + steps
        padded = None
        if not bool(mask.all()):
            grown = torch.ones(mask.shape[0], self.seen + width - mask.shape[1], dtype=torch.bool, device=mask.device)
            padded = torch.cat([mask, grown], dim=1).long()
        return {"positions": positions, "attention_mask": padded, "cache": self.cache}

    def advance(self, width: int) -> None:
        """The forward of `width` tokens is done: the cache holds them."""
        self.seen += width

    def sample(self, logits: torch.Tensor, sampling: Sampling, step: int) -> torch.Tensor:
        """Record the token of generation `step` from the last position's full logits [b, V]; finished rows take pad
        (log-prob 0). Returns the next input ids [b, 1]."""
        tokens, log_probs = pick(logits, sampling, self.rows, step)
        if self.finished is None:
            self.finished = torch.zeros(len(self.rows), dtype=torch.bool, device=tokens.device)
        tokens = tokens.masked_fill(self.finished, sampling.pad_token_id)
        self.tokens.append(tokens)
        self.log_probs.append(log_probs.masked_fill(self.finished, 0.0))
        if sampling.eos_token_id is not None:
            self.finished = self.finished | (tokens == sampling.eos_token_id)
        return tokens[:, None]

    @property
    def done(self) -> bool:
        """Every row emitted EOS."""
        return self.finished is not None and bool(self.finished.all())


def completions(parts: list[Sequences], steps: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's micro-batches, in row order -> tokens [B, steps] long and log-probs [B, steps] float32; a
    micro-batch that stopped early (every row past EOS) is filled with pad and log-prob 0."""
    tokens, log_probs = [], []
    for p in parts:
        done = torch.stack(p.tokens, dim=1)
        tokens.append(torch.nn.functional.pad(done, (0, steps - done.shape[1]), value=pad))
        log_probs.append(torch.nn.functional.pad(torch.stack(p.log_probs, dim=1), (0, steps - done.shape[1])))
    return torch.cat(tokens), torch.cat(log_probs)


def rollout(prompts: torch.Tensor, prompt_mask: torch.Tensor, tokens: torch.Tensor, log_probs: torch.Tensor,
            sampling: Sampling) -> Rollout:
    """The Rollout of generated `tokens` [B, steps], cut where `generate` stops: when every row emitted EOS."""
    tokens, log_probs = tokens.cpu(), log_probs.cpu().float()
    completion = torch.ones_like(tokens, dtype=torch.bool)
    if sampling.eos_token_id is not None:
        eos = (tokens == sampling.eos_token_id).long()
        after = (eos.cumsum(1) - eos) > 0  # strictly after the first EOS
        completion = ~after
    n = int(completion.sum(1).max()) if tokens.numel() else 0
    completion, tokens, log_probs = completion[:, :n], tokens[:, :n], log_probs[:, :n]
    tokens = tokens.masked_fill(~completion, sampling.pad_token_id)
    return Rollout(torch.cat([prompts.cpu(), tokens], dim=1), prompt_mask.cpu().bool(), completion,
                   log_probs.masked_fill(~completion, 0.0))


def check_prompts(prompts: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                  context: int | None = None) -> None:
    """Refuse what would generate garbage silently: shapes that differ, right padding, nothing to generate, more
    positions than the model's `context` (its rotary tables end there)."""
    if prompts.shape != prompt_mask.shape or prompts.dim() != 2:
        raise ValueError(f"prompts {tuple(prompts.shape)} and prompt_mask {tuple(prompt_mask.shape)} must be the "
                         "same [B, P]")
    if prompts.shape[1] == 0 or len(prompts) == 0:
        raise ValueError(f"prompts {tuple(prompts.shape)}: give at least one row of at least one token")
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded: every row's last prompt position is a real token")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens}: generate at least one token")
    if context is not None and prompts.shape[1] + sampling.max_new_tokens > context:
        raise ValueError(f"prompts of {prompts.shape[1]} tokens and max_new_tokens={sampling.max_new_tokens} are over "
                         f"the model's {context} positions (max_position_embeddings)")


@contextmanager
def generation_mode(modules: list[nn.Module]) -> Iterator[None]:
    """The modules in eval mode (no dropout, no router aux loss) for a generation, each put back as it was, and
    compiled layers (train.compile) run eagerly: the cache grows every step, so a compiled layer would recompile
    per token until dynamo gives up."""
    before = [[(m, m.training) for m in module.modules()] for module in modules]
    for module in modules:
        module.eval()
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for flags in before:
            for m, training in flags:
                m.training = training
