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
            f"| {o['speed_ratio']:.3f} ± {o['spread']:.3f} | {o['cpu_ratio']:.3f} |", ""] + _layouts(o)


def _layouts(o: dict) -> list[str]:
    """The same rollout in the training layouts pp2 and tp2 (two processes, one thread each) against one process."""
    lay = o.get("layouts")
    if not lay:
        return []
    rows = [f"| {name} | {row['speed_ratio']:.3f} ± {row['spread']:.3f} | "
            f"{', '.join(f'{b:.2f}' for b in row['bubble_by_rank'])} | {'yes' if row['tokens_equal'] else '**no**'} |"
            for name, row in ((name, lay[name]) for name in ("pp2", "tp2"))]
    return ["The same rollout in the training layouts, each rank one process with one thread, against one process "
            "(one thread): tokens/s of the layout over one process's, and each rank's idle share during the rollout "
            "(1 - the time inside its stages' forwards / the wall time).", "",
            "| layout | tokens/s, layout / one process | idle share by rank | same tokens |", "|---|---|---|---|",
            *rows, "",
            f"Why pp2 is slower here. The generation schedule itself idles a rank {lay['pp2']['schedule_bubble']:.1%} "
            f"of a round ({lay['ticks_per_round']} ticks of pp = 2 micro-batches; fill and drain cost pp - 1 "
            "forwards each round, where the last rank tells the others the round's tokens). The rest of the measured "
            "idle share is the token's round trip: micro-batch m's next tick needs its token back from the last "
            "stage, so the first stage waits a forward hop, the last stage's forward and the token's hop, less the one "
            "forward of the other micro-batch it runs meanwhile. At decode a forward is one token per row, well under "
            "a millisecond at this size, about what a gloo hop between two processes costs, so the hops are not "
            "hidden; prefill and longer rows (more work per forward) or more micro-batches in flight hide them, and "
            "NCCL's hops are tens of microseconds. Generation sends its messages over torch.distributed P2P even on "
            "one CPU host, where training takes the shared-memory transport and its shorter hop (the transport "
            "section below): carrying generation's messages there is the next step for CPU rollouts. tp2 has no bubble (the idle share is only the time outside "
            "forwards) but each layer's two all-reduces and each token's logits all-gather over gloo cost more than "
            "the halved matmuls save at hidden 256; on GPUs TP decode is bound by those collectives' latency too.", ""]
