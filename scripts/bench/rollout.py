"""Rollout decoding: Sluice's `engine.generate` (prefill, then one token per step over the family's key/value cache)
against transformers' `generate` with its own cache, on the same MiniMind model, prompts and greedy decoding, in one
process each; the ratio of their tokens/s. Then the same rollout in the training layouts pp2 and tp2 (two processes)
against one process, with each pipeline rank's idle share (its bubble). Writes the "rollout" section of results.json.

Each variant runs in a process of its own and they take turns, one generation each per round (A B, then B A) after
a warm-up, as overhead.py does and for its reasons: one computes at a time, and neither's allocations share a heap.
Both must produce the same tokens (greedy, no EOS: exactly `new_tokens` each); the script refuses figures otherwise.
The layouts take turns the same way (the one-process rollout on rank 0 while rank 1 waits); a rank's busy time is
the time inside its generation stages' forwards, its bubble 1 - busy / the rollout's wall time.

    python scripts/bench/rollout.py [--smoke] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import init_gloo, run_workers  # noqa: E402
from harness import Times, bench_parser, in_turn, ratio_and_spread, take_turns, timed, update_results  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from models import decoder_of  # noqa: E402
from parallel.engine import build_engine  # noqa: E402
from parallel.generation import Sampling  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.pipeline import generation_stage  # noqa: E402
from parallel.pipeline.rollouts import TICKS_PER_ROUND  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402


@dataclass(frozen=True)
class Setup:
    """Model and rollout sizes; the same in both processes."""

    layers: int
    hidden: int
    batch: int  # sequences decoded together (GRPO: prompts x num_generations)
    prompt: int  # prompt tokens, the first `padded` rows left-padded to half of it
    new_tokens: int
    warmup: int
    rounds: int
    padded: int = 2


def model(setup: Setup) -> MiniMindForCausalLM:
    """The MiniMind-3 shape (vocab 6400, 8 heads, 4 KV heads, tied embeddings) at the benchmark's size, eval mode."""
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=setup.hidden, num_hidden_layers=setup.layers,
                            max_position_embeddings=max(512, setup.prompt + setup.new_tokens))
    return MiniMindForCausalLM(config).eval()


def prompts(setup: Setup, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids [B, P] (pad 0) and their mask: a few rows half as long, as real prompts differ."""
    ids = torch.randint(1, vocab, (setup.batch, setup.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:setup.padded, :setup.prompt // 2] = False
    return ids.masked_fill(~mask, 0), mask


def sluice_generate(setup: Setup, pp: int = 1, tp: int = 1):
    """Sluice's engine in a layout (one process by default): `generate` as the GRPO step calls it (greedy here)."""
    grid = ParallelGrid.single("cpu") if pp * tp == 1 else ParallelGrid.build(1, tp, pp, backend="gloo", timeout_s=600)
    net = model(setup)
    engine = build_engine(default_engine_spec(PipelineSpec(pp=pp), 1, setup.prompt), decoder_of(net), grid)
    ids, mask = prompts(setup, net.config.vocab_size)
    sampling = Sampling(max_new_tokens=setup.new_tokens, temperature=0.0, eos_token_id=None)
    return lambda: engine.generate(ids, mask, sampling).tokens[:, setup.prompt:]


def transformers_generate(setup: Setup):
    """transformers' `generate` with its dynamic key/value cache, greedy, exactly `new_tokens` tokens."""
    net = model(setup)
    ids, mask = prompts(setup, net.config.vocab_size)

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = net.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=setup.new_tokens,
                               min_new_tokens=setup.new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        return out[:, setup.prompt:]

    return run


def worker(rank: int, world: int, setup: Setup) -> dict:
    """Rank 0 runs Sluice's generate, rank 1 transformers'; a barrier passes the turn, so one runs at a time."""
    init_gloo()
    torch.set_num_threads(1)  # the machine's other core belongs to whoever else runs
    run = (sluice_generate if rank == 0 else transformers_generate)(setup)
    tokens = run()
    return {"times": take_turns(run, rank, world, setup.warmup, setup.rounds), "tokens": tokens}


class BusyClock:
    """The time this process spends inside generation stages' forwards (the pipeline's compute, not its waits)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        forward = generation_stage.GenerationStage.forward

        def timed_forward(stage, *args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(stage, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        generation_stage.GenerationStage.forward = timed_forward


def layouts_worker(rank: int, world: int, setup: Setup) -> dict:
    """One process (rank 0 alone), pp2 and tp2 take turns; every rank returns its times and busy seconds."""
    init_gloo()
    torch.set_num_threads(1)
    clock = BusyClock()
    runs = {"pp2": sluice_generate(setup, pp=2), "tp2": sluice_generate(setup, tp=2)}
    if rank == 0:
        runs["one process"] = sluice_generate(setup)
    tokens = {name: run() for name, run in runs.items()}
    times = {name: Times() for name in ("one process", "pp2", "tp2")}
    busy: dict[str, list[float]] = {"pp2": [], "tp2": []}
    for k in range(setup.warmup + setup.rounds):
        for name in in_turn(times, k):
            dist.barrier()
            if name == "one process" and rank != 0:
                continue
            clock.seconds = 0.0
            wall, cpu, _ = timed(runs[name], everyone=name != "one process")  # one process: rank 1 waits
            if k >= setup.warmup:
                times[name].add(wall, cpu)
                if name in busy:
                    busy[name].append(clock.seconds / wall)
    dist.barrier()
    return {"times": times, "busy": busy, "tokens": tokens}


def layouts_section(setup: Setup) -> dict:
    """pp2 and tp2 rollouts against one process: tokens/s ratios, each rank's bubble, and the schedule's own."""
    by_rank = run_workers(layouts_worker, 2, setup, timeout=1800)
    one = by_rank[0]["times"]["one process"]
    out = {"ticks_per_round": TICKS_PER_ROUND}
    for name in ("pp2", "tp2"):
        spread = ratio_and_spread(one.wall, by_rank[0]["times"][name].wall)  # > 1: the layout decodes faster
        out[name] = {"speed_ratio": spread["ratio"], "spread": spread["spread"],
                     "tokens_equal": all(torch.equal(r["tokens"][name], by_rank[0]["tokens"]["one process"])
                                         for r in by_rank),
                     "bubble_by_rank": [1 - statistics.median(r["busy"][name]) for r in by_rank],
                     **by_rank[0]["times"][name].summary(name.replace(" ", "_"))}
    # The schedule's own idle share per round: fill and drain, pp - 1 forwards each of the round's ticks x M (M = pp
    # micro-batches): (pp - 1) / (ticks x pp + pp - 1) on every rank, before any wait for a hop.
    out["pp2"]["schedule_bubble"] = 1 / (TICKS_PER_ROUND * 2 + 1)
    out.update(one.summary("one_process"))
    return out


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "tiny model, 1 round: checks the script works", rounds=8, warmup=2)
    args = parser.parse_args(argv)
    if args.smoke:
        setup = Setup(layers=2, hidden=64, batch=2, prompt=8, new_tokens=4, warmup=1, rounds=1)
    else:  # GRPO's shape on a CPU: 2 prompts x 6 generations, MiniMind's small width
        setup = Setup(layers=4, hidden=256, batch=12, prompt=64, new_tokens=64, warmup=args.warmup, rounds=args.rounds)
    ours, theirs = run_workers(worker, 2, setup, timeout=1800)
    if not torch.equal(ours["tokens"], theirs["tokens"]):
        raise SystemExit("rollout: Sluice's greedy tokens differ from transformers' generate on the same model")
    tokens = setup.batch * setup.new_tokens
    sluice_t, torch_t = ours["times"].summary("sluice"), theirs["times"].summary("transformers")
    # tokens/s ratio = time ratio inverted: above 1, Sluice decodes faster.
    spread = ratio_and_spread(theirs["times"].wall, ours["times"].wall)
    section = {"speed_ratio": spread["ratio"], "spread": spread["spread"], "round_ratios": spread["round_ratios"],
               "sluice_tokens_per_s": tokens / sluice_t["sluice_s"],
               "transformers_tokens_per_s": tokens / torch_t["transformers_s"],
               "cpu_ratio": torch_t["transformers_cpu_s"] / sluice_t["sluice_cpu_s"], **sluice_t, **torch_t,
               "setup": asdict(setup), "layouts": layouts_section(setup)}
    update_results("rollout", section, args.results)
    print(f"rollout: Sluice {section['sluice_tokens_per_s']:.0f} tokens/s, transformers' generate "
          f"{section['transformers_tokens_per_s']:.0f} tokens/s: {section['speed_ratio']:.3f}x "
          f"(± {section['spread']:.3f}, {setup.rounds} rounds; CPU {section['cpu_ratio']:.3f}x)")
    for name in ("pp2", "tp2"):
        row = section["layouts"][name]
        print(f"rollout {name}: {row['speed_ratio']:.3f}x one process's tokens/s (± {row['spread']:.3f}), bubble by "
              f"rank {', '.join(f'{b:.3f}' for b in row['bubble_by_rank'])}, same tokens: {row['tokens_equal']}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
