"""Show what a run config would do, without launching anything: partition, schedule grid, bubble, memory, PNG;
or, with `--search`, every layout of a world size ranked by predicted step time under a memory budget.

    python scripts/preview.py model=tiny parallel.pp=4 schedule=1f1b schedule.n_microbatches=8 [--out=preview.png]
    python scripts/preview.py --search world_size=8 parallel.memory_budget_gb=16 model=minimind3
    python scripts/preview.py --generate model=tiny parallel.pp=4 schedule.n_microbatches=4 [--ticks=3]

Arguments are the Hydra overrides of train.py, plus `--out=PATH` (or `--out PATH`) for the timeline PNG, and
for the search `world_size=N` (default: the processes of the config as written). `--generate` draws the generation
schedule instead (one round of `--ticks` ticks over schedule.n_microbatches micro-batches of sequences).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from parallel.pipeline.actions import Lists  # noqa: E402
from parallel.pipeline.generation import generation_lists, simulate_generation  # noqa: E402
from parallel.pipeline.lowered import lower_pipeline  # noqa: E402
from parallel.pipeline.partition import stage_to_rank  # noqa: E402
from parallel.pipeline.render import step_text  # noqa: E402
from parallel.pipeline.simulate import peak_live  # noqa: E402
from parallel.pipeline.timeline import draw_timeline  # noqa: E402
from training.launch.cli import compose_validated, fail  # noqa: E402
from training.config import model_config  # noqa: E402
from training.config.schema import model_decoder  # noqa: E402
from training.config.layout import layout_world_size  # noqa: E402
from training.config.output_paths import output_file_problem  # noqa: E402
from training.layout_search.profile import measured_costs  # noqa: E402
from training.layout_search.search import search  # noqa: E402
from training.layout_search.search_report import chosen, no_fit_message, rejections, table  # noqa: E402
from training.specs import pipeline_spec  # noqa: E402

MEMORY_FORMULA = ("activation bytes = max over the step of sum over live (micro-batch, stage) of layers(stage) "
                  "x saved bytes of one decoder layer (the family's formula, e.g. "
                  "models.minimind.saved_activation_bytes_per_layer, with train.recompute, dtype and tp; "
                  "else one layer measured with saved-tensor hooks at tp=1)")


def split_args(argv: list[str]) -> tuple[list[str], Path]:
    """Hydra overrides and the PNG path (`--out=PATH`, `--out PATH`; default preview.png in the cwd)."""
    overrides, out, args = [], Path("preview.png"), iter(argv)
    for arg in args:
        if arg.startswith("--out="):
            out = Path(arg.split("=", 1)[1])
        elif arg == "--out":
            out = Path(next(args, "preview.png"))
        else:
            overrides.append(arg)
    return overrides, out


def count_arg(overrides: list[str], name: str, what: str) -> tuple[list[str], int | None]:
    """The script's own `name=N` (a positive count of `what`) taken out of the Hydra overrides."""
    found, rest = None, []
    for arg in overrides:
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
            if not value.isdigit() or int(value) < 1:
                fail(f"{name}={value} must be a positive number of {what}")
            found = int(value)
        else:
            rest.append(arg)
    return rest, found


def search_main(overrides: list[str], out: Path) -> int:
    """Rank every layout of the world size; print the table, the rejections, the best and its PNG."""
    overrides, world = count_arg(overrides, "world_size", "processes")
    cfg = compose_validated(overrides)
    world = world or layout_world_size(cfg)
    costs = measured_costs(cfg, world)
    result = search(cfg, world, costs)
    budget = cfg.parallel.memory_budget_gb
    print(f"search: {world} ranks, global batch {result.global_batch} sequences of {cfg.train.seq_len} tokens, "
          f"memory budget {f'{budget:g} GiB' if budget is not None else 'none'} per rank")
    print("\n".join(table(result)))
    print(f"rejected ({len(result.rejected)}):")
    print("\n".join(rejections(result)))
    best = result.best
    if best is None:
        fail(no_fit_message(result, cfg, costs))  # one line, exit 2, as layout=auto says it at launch
    print(f"best: {chosen(best)}")
    c = best.candidate
    title = f"best: {c.schedule}, dp={c.dp} tp={c.tp} pp={c.pp} vpp={c.vpp}, {c.n_microbatches} micro-batches"
    print(f"timeline: {draw_timeline(result.timeline(best, cfg, costs).sim, out, title, unit='s')}")
    return 0


def stage_parameters(cfg: DictConfig, partition: list[range]) -> tuple[list[int], int, bool]:
    """Parameters per stage (a tied lm_head counts on the last stage, which holds a copy), unique total, tied."""
    decoder = model_decoder(cfg)  # meta device: shapes only, no memory, no init time, any model size
    layer_stage = {layer: s for s, layers in enumerate(partition) for layer in layers}
    last = len(partition) - 1
    per_stage = [0] * len(partition)
    for name, param in decoder.module.named_parameters(remove_duplicate=False):
        piece, layer = decoder.plan.piece_of(name)
        stage = 0 if piece == "embedding" else layer_stage[layer] if piece == "layer" else last
        per_stage[stage] += param.numel()
    return per_stage, sum(p.numel() for p in decoder.module.parameters()), bool(decoder.plan.ties)


def activation_bytes(lowered: Lists, partition: list[range], cfg: DictConfig) -> list[int]:
    """Per rank, the peak of MEMORY_FORMULA over the lowered action list."""
    dtype_bytes = 2 if cfg.train.dtype == "bf16" else 4  # `auto` assumes fp32, the larger
    per_layer = model_decoder(cfg).adapter.saved_bytes_per_layer(cfg.train.micro_batch_size, cfg.train.seq_len,
                                                                 dtype_bytes, cfg.train.recompute, tp=cfg.parallel.tp)
    if per_layer is None:
        from training.layout_search.profile import layer_saved_bytes

        per_layer = layer_saved_bytes(cfg, cfg.train.recompute, torch.bfloat16 if dtype_bytes == 2 else torch.float32)
    # The simulator's count of live activations, each weighed by its stage's layers.
    return [peak_live(actions, lambda stage: len(partition[stage])) * per_layer for actions in lowered]


def short(name: str) -> str:
    """A dense module or parameter name without its owners (`model.embed_tokens` -> `embed_tokens`)."""
    return name.removesuffix(".weight").rsplit(".", 1)[-1]


def human(n: float) -> str:
    """Bytes in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: list[str]) -> int:
    """Print the preview of the composed config and write its timeline PNG."""
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        return 0
    overrides, out = split_args(argv)
    if problem := output_file_problem(out, "--out"):
        fail(problem)
    if "--search" in overrides:
        return search_main([o for o in overrides if o != "--search"], out)
    if "--generate" in overrides:
        return generation_main([o for o in overrides if o != "--generate"], out)
    cfg = compose_validated(overrides)
    p, m = cfg.parallel, cfg.schedule.n_microbatches
    pp, vpp = p.pp, p.vpp
    n_stages = pp * vpp
    try:
        pipeline = lower_pipeline(pipeline_spec(cfg), model_config(cfg).num_hidden_layers)
    except ValueError as error:
        fail(str(error))
    partition, placement, lowered = list(pipeline.partition), pipeline.placement, pipeline.lowered
    sim = pipeline.simulate()

    decoder = model_decoder(cfg)
    print(f"preview: model={cfg.model.name} ({decoder.config.num_hidden_layers} layers, hidden "
          f"{decoder.config.hidden_size}), "
          f"pp={pp} vpp={vpp} tp={p.tp} dp={p.dp or 'auto'}, schedule={cfg.schedule.name}, {m} micro-batches of "
          f"{cfg.train.micro_batch_size} x {cfg.train.seq_len} tokens")
    per_stage, total, tied = stage_parameters(cfg, partition)
    print(f"partition: {n_stages} stages, placement {placement}")
    for s, layer_range in enumerate(partition):
        extras = [x for x, here in ((short(decoder.plan.embedding), s == 0), (" + ".join(
            short(n) for n in (*decoder.plan.finals, decoder.plan.head)), s == n_stages - 1)) if here]
        first, last = layer_range.start, layer_range.stop - 1
        span = f"layers {first}-{last}" if last > first else f"layer {first}"
        print(f"  stage {s} on rank {stage_to_rank(s, pp, placement)}: {span} ({len(layer_range)})"
              f"{' + ' + ', '.join(extras) if extras else ''}, {per_stage[s]:,} params")
    tie = ", ".join(f"{short(a)} tied to {short(b)}" for a, b in decoder.plan.ties.items())
    note = f" ({tie}: counted once; the last stage holds a copy)" if tied and n_stages > 1 else ""
    print(f"  total {total:,} parameters{note}")
    print("schedule:")
    print(step_text(lowered, pp, n_stages, m, placement, simulated=sim))
    print(f"predicted: makespan {sim.makespan:g} cost units, bubble fraction {sim.bubble_fraction:.1%}")
    memory = activation_bytes(lowered, partition, cfg)
    for r in range(pp):
        print(f"  rank {r}: peak live micro-batches {sim.peak_live[r]}, peak activation memory "
              f"{memory[r]:,} bytes ({human(memory[r])})")
    print(f"  ({MEMORY_FORMULA}; per tensor-parallel rank)")
    title = f"{cfg.schedule.name}, pp={pp} vpp={vpp}, {m} micro-batches"
    print(f"timeline: {draw_timeline(sim, out, title)}")
    return 0


def generation_main(overrides: list[str], out: Path) -> int:
    """Draw one round of the generation schedule of the config's pipeline: its verified lists, grid and timeline."""
    rest, ticks = count_arg(overrides, "--ticks", "ticks")
    ticks = ticks or 3  # the default round: fill, one steady tick, drain
    cfg = compose_validated(rest)
    try:
        pipeline = lower_pipeline(pipeline_spec(cfg), model_config(cfg).num_hidden_layers)
        pp, n, placement, m = pipeline.spec.pp, pipeline.n_stages, pipeline.placement, cfg.schedule.n_microbatches
        lowered = generation_lists(pp, n, placement, m, ticks)
    except ValueError as error:
        fail(str(error))
    sim = simulate_generation(lowered, pp, n, placement, m)
    print(f"preview: generation on pp={pp} ({n} stages, placement {placement}), {m} micro-batches of sequences, "
          f"one round of {ticks} ticks; F<u> is micro-batch u % {m} at tick u // {m} (tick 0: the prompt)")
    print(step_text(lowered, pp, n, ticks * m, placement, simulated=sim))
    print(f"predicted: {ticks * m} forwards per stage in {sim.makespan:g} units, bubble fraction "
          f"{sim.bubble_fraction:.1%} (the fill and drain of pp - 1 forwards; with fewer micro-batches than stages "
          "every tick waits for its token)")
    print("lists (verified: every message matched, no deadlock):")
    for r, actions in enumerate(lowered):
        print(f"  rank {r}: {' '.join(map(str, actions))}")
    print(f"timeline: {draw_timeline(sim, out, f'generation, pp={pp}, {m} micro-batches, {ticks} ticks')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
