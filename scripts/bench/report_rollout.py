"""The benchmark page's rollout section: decoding in the training layout against transformers' `generate` (apart
from report.py to keep each file short)."""

from __future__ import annotations


def rollout_acceptance(r: dict) -> list[tuple[str, str, bool]]:
    """The acceptance row of issue 45: one-process decode tokens/s at least transformers' `generate`'s."""
    if "rollout" not in r:
        return []
    o = r["rollout"]
    return [("rollout decode tokens/s at least 1.0x transformers' `generate` (one process, greedy, same tokens)",
             f"{o['speed_ratio']:.3f} ± {o['spread']:.3f}", o["speed_ratio"] >= 1.0)]


def rollout_section(r: dict) -> list[str]:
    """One-process decoding: Sluice's `engine.generate` against transformers' `generate`, tokens/s."""
    o = r.get("rollout")
    if not o:
        return []
    s = o["setup"]
    return ["## Rollouts: decoding against transformers' `generate`", "",
            "GRPO's rollouts as `train.task=grpo` makes them: `engine.generate` prefills the left-padded prompts, then "
            "decodes one token per step over the family's key/value cache (`scripts/bench/rollout.py`). transformers' "
            "`generate` runs on the same MiniMind model (vocab 6400, 8 heads, 4 KV heads, tied embeddings) with its "
            "own dynamic cache, greedy, with the same prompts; both must produce the same tokens. One process each, "
            "one thread, taking turns (A B, then B A) after a warm-up. fp32.", "",
            "| layers x hidden | sequences x (prompt + new) tokens | Sluice tokens/s | `generate` tokens/s "
            "| Sluice / `generate` (tokens/s) | CPU time `generate` / Sluice |", "|---|---|---|---|---|---|",
            f"| {s['layers']} x {s['hidden']} | {s['batch']} x ({s['prompt']} + {s['new_tokens']}) "
            f"| {o['sluice_tokens_per_s']:.0f} | {o['transformers_tokens_per_s']:.0f} "
            f"| {o['speed_ratio']:.3f} ± {o['spread']:.3f} | {o['cpu_ratio']:.3f} |", ""]
