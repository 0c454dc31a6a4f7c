"""Rollouts as training rows, group advantages, and the sample file `<run dir>/rollouts.jsonl`.

The training row of a completion is its prompt's real tokens, then the completion (padded after EOS to
`grpo.max_new_tokens`), then the prompt's left padding moved to the end: the policy then sees the positions and the
context generation saw (positions from 0 at the first real token, no padding before it, as `generate`'s padding mask
and positions make them), and the padding at the end is never attended by a real token (causal attention).
"""

import json
import os
import stat
from pathlib import Path

import torch

from checkpoint.atomic_write import write_text
from parallel.step import IGNORE_INDEX

STD_EPSILON = 1e-4  # MiniMind's train_grpo.py: (r - mean) / (std + 1e-4), std of the group without Bessel's correction


def group_advantages(rewards: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, flat) of [B] float32 rewards in consecutive groups of `group`: (r - group mean) / (group std +
    1e-4), and whether the row's group had equal rewards (zero spread: its advantages are exactly 0, not NaN)."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    std = grouped.std(dim=1, unbiased=False).repeat_interleave(group)
    return (rewards - mean) / (std + STD_EPSILON), std == 0


def training_rows(tokens: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor, width: int,
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, P + width], labels, starts [B]) of a rollout: each row rolled left by its prompt padding, the
    completion's tokens (up to and including EOS) its labels, and `starts` the index of its first completion token's
    log-probability among the shifted positions (the real prompt length - 1)."""
    rows, prompt = prompt_mask.shape
    completion = tokens[:, prompt:]
    pad = width - completion.shape[1]
    ids = torch.cat([tokens, completion.new_full((rows, pad), pad_id)], dim=1)
    mask = torch.cat([torch.zeros_like(prompt_mask), completion_mask, completion_mask.new_zeros(rows, pad)], dim=1)
    labels = torch.where(mask, ids, IGNORE_INDEX)
    padding = (~prompt_mask).sum(dim=1)
    order = (torch.arange(ids.shape[1]) + padding[:, None]) % ids.shape[1]
    return ids.gather(1, order), labels.gather(1, order), prompt - padding - 1


def padded(values: torch.Tensor, width: int) -> torch.Tensor:
    """[B, n] -> [B, width] with zeros after."""
    return torch.cat([values, values.new_zeros(values.shape[0], width - values.shape[1])], dim=1)


def write_samples(run_dir: Path, step: int, records: list[dict]) -> None:
    """Add `records` (one completion each) to `<run_dir>/rollouts.jsonl`, dropping lines of step >= `step` a resumed
    run wrote before: the file is rewritten under a temporary name in the run directory and renamed into place, and
    a link there is refused."""
    path = run_dir / "rollouts.jsonl"
    kept = []
    if os.path.lexists(path):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(f"{path} is not a regular file (a link?); Sluice writes rollouts.jsonl only as its own file")
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line)["step"]) < step:
                    kept.append(line)
            except (ValueError, TypeError, KeyError):
                continue  # a torn line of a killed run
    lines = kept + [json.dumps(r, ensure_ascii=False) for r in records]
    write_text(path, "".join(line + "\n" for line in lines), "rollouts.jsonl", OSError)
