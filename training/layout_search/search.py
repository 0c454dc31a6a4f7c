"""The layout search: every layout of a world size (for a MoE model also every expert-parallel split of its DP
ranks, and every ZeRO level) at a fixed global batch, checked by the pre-launch rules, predicted with measured costs,
held to the memory budget and ranked by predicted step time."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from parallel.pipeline.schedules import SCHEDULES
from training.layout_search.balance import cost_balanced_partition, measured_weights
from training.config.schema import model_config
from training.config.run_model import scope_problem
from training.layout_search.costs import MeasuredCosts
from training.layout_search.predict import Candidate, Prediction, predict
from training.config.layout import resolve_global_batch
from training.rules.values import ConfigError
from training.config.layout_checks import experts_problem, model_split_problem, parallel_problem, zero_problem

GIB = 1 << 30
Predictor = Callable[[Candidate, DictConfig, MeasuredCosts], Prediction]  # `predict`, or a fake in tests
# Each mode saves memory and costs time over the one before: a later one is tried only where none before fits.
RECOMPUTE_ORDER = ("none", "selective", "full")
MICRO_BATCH_DIVISORS = (1, 2, 4)  # micro-batch sizes tried: the config's, its half and its quarter
VIRTUAL_STAGES = (2, 4)  # vpp tried by the schedules that need virtual stages (the search refuses what fails)
ZERO_LEVELS = (0, 1, 2, 3)  # parallel.zero tried at dp >= 2 when the config leaves it at 0 (a level it sets is kept)


@dataclass(frozen=True)
class Option:
    """A valid candidate with its predicted step and peaks; `fits` is False when its peak exceeds the budget. The
    simulated timeline is not kept (at pp=64, m=1024 each holds millions of times): `timeline` redoes it."""

    candidate: Candidate
    step_s: float
    peak_bytes: tuple[int, ...]
    fits: bool

    @property
    def peak(self) -> int:
        """The largest predicted peak over pipeline ranks (bytes)."""
        return max(self.peak_bytes)


@dataclass(frozen=True)
class Rejected:
    """A candidate the search refused, and the one-line reason."""

    candidate: Candidate
    reason: str


@dataclass
class SearchResult:
    """Every candidate of one search: the predicted ones by step time (fitting first), and the rejected."""

    world_size: int
    global_batch: int
    budget_gb: float | None
    predictor: Predictor = field(repr=False)  # what predicted these (the no-fit advice predicts a few more)
    options: list[Option] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def budget_bytes(self) -> int | None:
        """The memory budget per rank in bytes (None: no budget)."""
        return None if self.budget_gb is None else int(self.budget_gb * GIB)

    @property
    def best(self) -> Option | None:
        """The fastest candidate within the budget, if any."""
        return next((o for o in self.options if o.fits), None)

    @property
    def smallest_peak(self) -> Option | None:
        """The candidate with the lowest predicted peak (what comes closest to a budget nothing fits)."""
        return min(self.options, key=lambda o: (o.peak, o.step_s), default=None)

    def timeline(self, option: Option, cfg: DictConfig, costs: MeasuredCosts) -> Prediction:
        """The full prediction of one option, simulated timeline included (for its picture)."""
        return self.predictor(option.candidate, cfg, costs)


def global_batch(cfg: DictConfig) -> int:
    """Sequences per optimizer step the search holds fixed: train.global_batch_size, else the config's own."""
    fixed = OmegaConf.select(cfg, "train.global_batch_size")
    written = cfg.schedule.n_microbatches * cfg.train.micro_batch_size * (cfg.parallel.dp or 1)
    return written if fixed is None else int(fixed)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(world_size: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) whose product is the world size."""
    return [(world_size // (tp * pp), tp, pp) for tp in divisors(world_size) for pp in divisors(world_size // tp)]


def schedule_choices(pp: int) -> list[tuple[str, int]]:
    """(schedule, vpp) pairs to try: one stage per rank needs no schedule; vpp only where a schedule needs it."""
    if pp == 1:
        return [("1f1b", 1)]  # a single stage is gradient accumulation whatever the schedule's name
    return [(name, vpp) for name, registered in sorted(SCHEDULES.items())
            for vpp in (VIRTUAL_STAGES if registered.default_vpp > 1 else (1,))]


def micro_batch_sizes(cfg: DictConfig, per_replica: int) -> list[int]:
    """The config's micro-batch size and its halves that divide a replica's share of the global batch (even ones
    under train.task=dpo: a micro-batch holds whole pairs)."""
    b0 = cfg.train.micro_batch_size
    sizes = [b0 // k for k in MICRO_BATCH_DIVISORS if b0 % k == 0]
    pairs = OmegaConf.select(cfg, "train.task") == "dpo"
    return [b for b in sizes if per_replica % b == 0 and not (pairs and b % 2)]


def apply_candidate(cfg: DictConfig, candidate: Candidate) -> DictConfig:
    """A copy of cfg with the candidate's layout (what composing with `candidate.overrides()` gives)."""
    c, out = candidate, cfg.copy()
    with read_write(out), open_dict(out):
        out.parallel.update(dp=c.dp, tp=c.tp, pp=c.pp, vpp=c.vpp, ep=c.ep, zero=c.zero, layout=None,
                            layers_per_stage=list(c.layers_per_stage) if c.layers_per_stage else None)
        out.schedule.update(name=c.schedule, n_microbatches=c.n_microbatches)
        out.train.update(micro_batch_size=c.micro_batch_size, recompute=c.recompute)
        if OmegaConf.select(out, "train.global_batch_size") is not None:
            out.train.global_batch_size = c.dp * c.n_microbatches * c.micro_batch_size
    return out


def layout_problem(cfg: DictConfig, candidate: Candidate, world_size: int) -> str | None:
    """The pre-launch check's one line for this candidate's shape, or None when it is valid (its zero level's
    rule, `zero_problem`, the search checks apart: it depends on dp and ep only)."""
    candidate_cfg = apply_candidate(cfg, candidate)
    if problem := parallel_problem(candidate_cfg, world_size):
        return problem
    try:
        resolve_global_batch(candidate_cfg, world_size)
    except ConfigError as error:
        return str(error)
    return model_split_problem(candidate_cfg) or experts_problem(candidate_cfg, world_size)


def partitions(cfg: DictConfig, pp: int, vpp: int, costs: MeasuredCosts) -> list[tuple[int, ...] | None]:
    """The even split, and the cost-balanced one where it differs."""
    layers, stages = model_config(cfg).num_hidden_layers, pp * vpp
    if stages == 1 or stages > layers:
        return [None]
    embed, head = measured_weights(costs, "none")
    balanced = cost_balanced_partition(layers, stages, embed=embed, head=head)
    even = tuple(layers * (s + 1) // stages - layers * s // stages for s in range(stages))
    return [None] if balanced == even else [None, balanced]


def expert_choices(cfg: DictConfig, dp: int) -> list[int]:
    """parallel.ep values to try: 1, and for a MoE model every split of the experts over some of the DP ranks."""
    config = model_config(cfg)
    experts = getattr(config, "num_experts", 0) if getattr(config, "use_moe", False) else 0
    return [ep for ep in divisors(dp) if ep == 1 or (experts and experts % ep == 0)]


def batch_problem(total: int, dp: int, b0: int) -> str | None:
    """Why a replica count cannot hold the global batch at the config's micro-batch size or its halves."""
    if total % dp:
        return f"the global batch of {total} sequences does not split over dp={dp}"
    return f"{total // dp} sequences per replica is not a multiple of train.micro_batch_size={b0} or its halves"


def structures(cfg: DictConfig, world_size: int, costs: MeasuredCosts) -> Iterator[Candidate | Rejected]:
    """Every candidate shape (recompute none), or one rejection per layout whose replicas cannot share the batch."""
    total, b0 = global_batch(cfg), cfg.train.micro_batch_size
    for dp, tp, pp in layouts(world_size):
        sizes = micro_batch_sizes(cfg, total // dp) if total % dp == 0 else []
        experts = expert_choices(cfg, dp)
        for schedule, vpp in schedule_choices(pp):
            base = Candidate(dp=dp, tp=tp, pp=pp, vpp=vpp, schedule=schedule, n_microbatches=max(total // dp, 1),
                             micro_batch_size=b0, recompute="none", zero=cfg.parallel.zero)
            if not sizes:
                yield Rejected(base, batch_problem(total, dp, b0))
                break  # the same reason for every schedule of this layout: say it once
            for b in sizes:
                for split in partitions(cfg, pp, vpp, costs):
                    for ep in experts:
                        yield replace(base, micro_batch_size=b, n_microbatches=total // (dp * b),
                                      layers_per_stage=split, ep=ep)


def evaluate(candidate: Candidate, cfg: DictConfig, costs: MeasuredCosts, result: SearchResult) -> None:
    """Predict a valid shape at each recompute mode in turn until one fits; record options and rejections."""
    budget = result.budget_bytes
    for mode in RECOMPUTE_ORDER:
        trial = replace(candidate, recompute=mode)
        prediction = result.predictor(trial, cfg, costs)
        option = Option(trial, prediction.step_s, prediction.peak_bytes,
                        budget is None or max(prediction.peak_bytes) <= budget)
        result.options.append(option)
        if option.fits:
            return
        result.rejected.append(Rejected(trial, f"predicted peak {option.peak / GIB:.3g} GiB per rank exceeds "
                                               f"parallel.memory_budget_gb={result.budget_gb:g}"))


def rank_key(option: Option) -> tuple:
    """Fitting first, then faster; equal predictions (to 6 digits) prefer the larger micro-batch, then less memory.
    Costs scale linearly with the micro-batch from the measured one, so m x b = constant predicts a tie; a real device
    runs fewer, larger kernels no slower (per-kernel overheads), so the tie goes to the larger b."""
    return not option.fits, float(f"{option.step_s:.6g}"), -option.candidate.micro_batch_size, option.peak


def search(cfg: DictConfig, world_size: int, costs: MeasuredCosts, predictor: Predictor = predict) -> SearchResult:
    """Enumerate, check, predict and rank every layout of `world_size` processes at the config's global batch."""
    result = SearchResult(world_size, global_batch(cfg), OmegaConf.select(cfg, "parallel.memory_budget_gb"), predictor)
    problems: dict[tuple, str | None] = {}  # the rules depend on the shape, a zero level's on dp and ep: check once
    for item in structures(cfg, world_size, costs):
        if isinstance(item, Rejected):
            result.rejected.append(item)
            continue
        shape = (item.tp, item.pp, item.vpp, item.schedule, item.n_microbatches, item.layers_per_stage, item.ep)
        if shape not in problems:
            problems[shape] = layout_problem(cfg, item, world_size)
        searched = not problems[shape] and not item.zero and item.dp > 1  # a level the config sets is kept
        for c in [replace(item, zero=z) for z in ZERO_LEVELS] if searched else [item]:
            if (level := (c.dp, c.ep, c.zero)) not in problems:
                applied = apply_candidate(cfg, c)  # with its level: bf16 gathers, HSDP, offload need FSDP's
                problems[level] = zero_problem(applied, c.dp) or scope_problem(applied)
            if problem := problems[shape] or problems[level]:
                result.rejected.append(Rejected(c, problem))
            else:
                evaluate(c, cfg, costs, result)
    result.options.sort(key=rank_key)
    result.rejected.sort(key=lambda r: r.reason.startswith("predicted peak"))  # broken rules first, stable
    return result
