"""What a search says to the user: the ranked table, the rejections, the chosen overrides, and the one line when
nothing fits the memory budget (with what would)."""

from dataclasses import replace

from omegaconf import DictConfig

from training.layout_search.costs import MeasuredCosts
from training.layout_search.predict import Candidate
from training.layout_search.search import GIB, Option, SearchResult, layout_problem

TABLE_ROWS = 20  # the ranked table shows the fastest ones; the rest are counted
REJECTED_ROWS = 30
MAX_SCALE = 8  # "more ranks" tries up to 8x the world size


def gib(n: float) -> str:
    """Bytes as GiB with three significant digits."""
    return f"{n / GIB:.3g} GiB"


def short(candidate: Candidate) -> str:
    """The candidate in one compact column."""
    c = candidate
    split = "even" if c.layers_per_stage is None else "[" + ",".join(map(str, c.layers_per_stage)) + "]"
    ep, zero = f" ep={c.ep}" if c.ep > 1 else "", f" zero={c.zero}" if c.zero else ""
    return (f"dp={c.dp}{ep}{zero} tp={c.tp} pp={c.pp} vpp={c.vpp} {c.schedule} m={c.n_microbatches} "
            f"b={c.micro_batch_size} recompute={c.recompute} layers={split}")


def table(result: SearchResult) -> list[str]:
    """The ranked table: fitting candidates by predicted step time, then those over the budget."""
    width = max((len(short(o.candidate)) for o in result.options[:TABLE_ROWS]), default=10)
    lines = [f"{'rank':>4}  {'candidate':<{width}}  {'step s':>9}  {'peak/rank':>11}  fits"]
    rank = 0
    for option in result.options[:TABLE_ROWS]:
        rank += option.fits
        label = str(rank) if option.fits else "-"
        lines.append(f"{label:>4}  {short(option.candidate):<{width}}  {option.step_s:>9.4g}  "
                     f"{gib(option.peak):>11}  {'yes' if option.fits else 'no'}")
    if len(result.options) > TABLE_ROWS:
        lines.append(f"  ... and {len(result.options) - TABLE_ROWS} more predicted candidates")
    return lines


def rejections(result: SearchResult) -> list[str]:
    """One line per rejected candidate with its reason (the first REJECTED_ROWS, then a count)."""
    lines = [f"  {short(r.candidate)}: {r.reason}" for r in result.rejected[:REJECTED_ROWS]]
    if len(result.rejected) > REJECTED_ROWS:
        lines.append(f"  ... and {len(result.rejected) - REJECTED_ROWS} more")
    return lines


def chosen(option: Option) -> str:
    """What the best candidate is and what it is predicted to do."""
    return (f"{' '.join(option.candidate.overrides())} (predicted {option.step_s:.4g} s/step, "
            f"peak {gib(option.peak)} per rank)")


def _fitting(trial: Candidate, cfg: DictConfig, costs: MeasuredCosts, result: SearchResult,
             world_size: int) -> int | None:
    """The trial's predicted peak when it is a valid layout within the budget, else None."""
    if layout_problem(cfg, trial, world_size):
        return None
    peak = max(result.predictor(trial, cfg, costs).peak_bytes)
    return peak if peak <= result.budget_bytes else None


def more_ranks(best: Candidate, cfg: DictConfig, costs: MeasuredCosts, result: SearchResult) -> str | None:
    """The fewest extra ranks (deeper pipeline first, then wider TP) with which the closest candidate fits."""
    world_size = result.world_size
    for scale in (2, 4, MAX_SCALE):
        for trial in (replace(best, pp=best.pp * scale, layers_per_stage=None),
                      replace(best, tp=best.tp * scale)):
            peak = _fitting(trial, cfg, costs, result, world_size * scale)
            if peak is not None:
                axis = f"parallel.pp={trial.pp}" if trial.pp != best.pp else f"parallel.tp={trial.tp}"
                return f"world_size={world_size * scale} with {axis} ({gib(peak)})"
    return None


def smaller_micro_batch(best: Candidate, cfg: DictConfig, costs: MeasuredCosts, result: SearchResult) -> str | None:
    """The largest smaller micro-batch (same global batch) with which the closest candidate fits."""
    b = best.micro_batch_size // 2
    while b >= 1:
        if (best.micro_batch_size * best.n_microbatches) % b == 0:
            m = best.micro_batch_size * best.n_microbatches // b
            peak = _fitting(replace(best, micro_batch_size=b, n_microbatches=m), cfg, costs, result, result.world_size)
            if peak is not None:
                return f"train.micro_batch_size={b} schedule.n_microbatches={m} ({gib(peak)})"
        b //= 2
    return None


def no_fit_message(result: SearchResult, cfg: DictConfig, costs: MeasuredCosts) -> str:
    """One line: nothing fits the budget, the smallest peak found, and what would fit."""
    closest = result.smallest_peak
    ranks = f"{result.world_size} rank{'s' if result.world_size > 1 else ''}"
    head = f"no layout of {ranks} fits parallel.memory_budget_gb={result.budget_gb:g}"
    if closest is None:
        return f"{head}: no valid layout at all (see the rejected candidates)"
    c = closest.candidate
    said = f"{head}: the smallest predicted peak is {gib(closest.peak)} per rank ({short(c)})"
    full = replace(c, recompute="full")
    fixes = [more_ranks(c, cfg, costs, result),
             "train.recompute=full" if c.recompute != "full" and _fitting(full, cfg, costs, result, result.world_size)
             else None,
             smaller_micro_batch(c, cfg, costs, result)]
    fixes = [f for f in fixes if f]
    if fixes:
        return f"{said}; would fit: {' or '.join(fixes)}"
    return (f"{said}; neither up to {MAX_SCALE}x the ranks, recompute=full nor a smaller micro-batch fits: "
            f"raise parallel.memory_budget_gb to at least {closest.peak / GIB:.3g}")
