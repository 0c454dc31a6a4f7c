"""The model of one layout's optimizer step: the pipeline simulated with measured per-stage costs, plus TP and
DP communication and the optimizer; and its peak memory per pipeline rank."""

from dataclasses import dataclass

from omegaconf import DictConfig

from parallel.pipeline.actions import B, F, I, W, Costs, Lists
from parallel.pipeline.lowered import LoweredPipeline, lower_pipeline
from parallel.pipeline.partition import rank_stages
from parallel.pipeline.simulate import SimResult
from parallel.spec import PipelineSpec
from training.layout_search.costs import ADAMW_STATE_BYTES, MeasuredCosts
from training.config.schema import model_config
from training.specs import pipeline_spec


@dataclass(frozen=True)
class Candidate:
    """One layout of a world: sizes, schedule, micro-batching, recomputation, partition and ZeRO level."""

    dp: int
    tp: int
    pp: int
    vpp: int
    schedule: str
    n_microbatches: int
    micro_batch_size: int
    recompute: str  # none | full | selective
    layers_per_stage: tuple[int, ...] | None = None  # None: the even split
    ep: int = 1  # DP ranks splitting each MoE layer's experts
    zero: int = 0  # parallel.zero

    def overrides(self) -> list[str]:
        """Hydra overrides that select it."""
        out = [f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
               f"parallel.vpp={self.vpp}", f"schedule={self.schedule}",
               f"schedule.n_microbatches={self.n_microbatches}", f"train.micro_batch_size={self.micro_batch_size}",
               f"train.recompute={self.recompute}"]
        if self.layers_per_stage is not None:
            out.append(f"parallel.layers_per_stage=[{','.join(map(str, self.layers_per_stage))}]")
        return out + [f"parallel.ep={self.ep}"] * (self.ep > 1) + [f"parallel.zero={self.zero}"] * (self.zero > 0)


@dataclass(frozen=True)
class Prediction:
    """Predicted optimizer-step time and peak bytes per pipeline rank, with the simulated timeline."""

    step_s: float
    peak_bytes: tuple[int, ...]  # params + grads + optimizer state + live activations, on the device
    sim: SimResult
    host_bytes: tuple[int, ...] = ()  # parallel.cpu_offload: the shards, their gradients and AdamW state, on the host


@dataclass(frozen=True)
class StageModel:
    """Seconds and bytes of each global stage of one candidate."""

    costs: Costs  # per-stage F/B/I/W and per-boundary comm, seconds
    saved: tuple[int, ...]  # bytes saved for backward per micro-batch
    deferred: tuple[int, ...]  # bytes held between I and W per micro-batch
    params: tuple[int, ...]  # parameters held (a tied lm_head copy counts on the last stage)
    experts: tuple[int, ...]  # of those, the EP-split experts' (their gradients and ZeRO shards span edp only)


def candidate_of(cfg: DictConfig, dp: int | None = None) -> Candidate:
    """The layout `cfg` describes."""
    p = cfg.parallel
    counts = p.layers_per_stage
    layers = None if counts is None or isinstance(counts, str) else tuple(counts)  # `auto` not resolved: even
    return Candidate(dp=dp or p.dp or 1, tp=p.tp, pp=p.pp, vpp=p.vpp, schedule=pipeline_spec(cfg).schedule,
                     n_microbatches=cfg.schedule.n_microbatches, micro_batch_size=cfg.train.micro_batch_size,
                     recompute=cfg.train.recompute, layers_per_stage=layers, ep=p.ep, zero=p.zero)


def lowered_of(candidate: Candidate, num_layers: int, table_path: str | None = None) -> LoweredPipeline:
    """The checked pipeline of a candidate (pp=1: one stage under 1F1B, i.e. gradient accumulation); `table_path`:
    the file of `schedule=table`."""
    c = candidate
    spec = PipelineSpec(pp=c.pp, vpp=c.vpp, schedule=c.schedule if c.pp > 1 else "1f1b",
                        n_microbatches=c.n_microbatches, table_path=table_path, layers_per_stage=c.layers_per_stage)
    return lower_pipeline(spec, num_layers)


def _piece(costs: MeasuredCosts, name: str, scale: float) -> float:
    """Seconds of one piece (`layer_b.full`, `head_f`, ...) at `scale` times the profiled micro-batch."""
    field, _, mode = name.partition(".")
    value = getattr(costs, field)
    return costs.scaled(name, value[mode] if mode else value, scale)


def stage_model(candidate: Candidate, pipeline: LoweredPipeline, costs: MeasuredCosts, tied: bool,
                top_k: int = 1) -> StageModel:
    """Per-stage durations and bytes: layers x per-layer cost, the embedding on stage 0, the head on the last.
    Measured at tp=1 and the profiled micro-batch: compute (past its fixed part) and activations scale with it and
    divide by tp; TP adds two activation all-reduces per layer in F and two in B (Megatron's f/g). EP keeps 1/ep of each
    layer's experts and moves each token's `top_k` rows out and back: two all_to_alls per MoE layer in F and two in B,
    each a 1/ep share of the rows to each of the ep-1 peers. The expert compute per rank is unchanged (balanced routing:
    the rows of ep ranks for 1/ep of the experts)."""
    c, n = candidate, pipeline.n_stages
    scale = c.micro_batch_size / costs.key["micro_batch_size"]
    act = costs.boundary_bytes * scale
    tp_ar = 0.0 if c.tp == 1 else costs.allreduce.time(act)  # one TP all-reduce of the activations
    split_experts = c.ep > 1 and costs.layer_expert_params > 0
    a2a = (c.ep - 1) * costs.p2p.time(act * top_k / c.ep) if split_experts else 0.0
    layer_experts = costs.layer_expert_params // c.ep if split_experts else 0
    layer_params = costs.layer_params - (costs.layer_expert_params - layer_experts if split_experts else 0)
    mode = c.recompute
    kinds = {"f": [], "b": [], "i": [], "w": []}
    saved, deferred, params, experts = [], [], [], []
    for s, layers in enumerate(pipeline.partition):
        k, first, last = len(layers), s == 0, s == n - 1
        for kind, values in kinds.items():
            t = (k * _piece(costs, "layer_" + kind + (f".{mode}" if kind in "bi" else ""), scale)
                 + first * _piece(costs, "embed_" + kind, scale) + last * _piece(costs, "head_" + kind, scale))
            comm = 0.0 if kind == "w" else (2 * k + first + last) * tp_ar + 2 * k * a2a  # W moves nothing
            values.append(t / c.tp + comm)
        saved.append(int((k * costs.layer_saved[mode] + first * costs.embed_saved + last * costs.head_saved)
                         * scale / c.tp))
        deferred.append(int((k * costs.layer_deferred + last * costs.head_deferred) * scale / c.tp))
        copy = last and tied and n > 1 and pipeline.placement != "v"  # a V placement's last stage sits with stage 0
        params.append((k * layer_params + first * costs.embed_params + last * costs.head_params
                       + copy * costs.embed_params) // c.tp)
        experts.append(k * layer_experts // c.tp)
    comm = costs.p2p.time(act) if n > 1 else 0.0
    stage_costs = Costs(stage_f=tuple(kinds["f"]), stage_b=tuple(kinds["b"]), stage_i=tuple(kinds["i"]),
                        stage_w=tuple(kinds["w"]), stage_comm=(comm,) * (n - 1))
    return StageModel(stage_costs, tuple(saved), tuple(deferred), tuple(params), tuple(experts))


def live_peak(actions: Lists, saved: tuple[int, ...], deferred: tuple[int, ...]) -> int:
    """Most activation bytes one rank holds: F saves its stage's bytes until B (or I) frees them; I keeps
    the weight-gradient inputs until W."""
    live = peak = 0
    for kind, _, stage in actions:
        if kind is F:
            live += saved[stage]
        elif kind is B:
            live -= saved[stage]
        elif kind is I:  # the linears' saved inputs stay, as W's, with their output gradients
            live += deferred[stage] - saved[stage]
        elif kind is W:
            live -= deferred[stage]
        peak = max(peak, live)
    return peak


def _dp_allreduce(costs: MeasuredCosts, dp: int, nbytes: float, bucket_bytes: float) -> float:
    """Bucketed ring all-reduce of `nbytes` over dp ranks, from the two-rank fit (ring: 2(dp-1)/dp per byte)."""
    if dp == 1 or nbytes <= 0:
        return 0.0
    buckets = max(1, -(-int(nbytes) // int(bucket_bytes)))
    ring = (dp - 1) / dp * 2  # two ranks: 1, as measured
    return buckets * costs.allreduce.latency_s * (dp - 1) + nbytes * costs.allreduce.per_byte_s * ring


def _dp_sync(cfg: DictConfig, c: Candidate, costs: MeasuredCosts, dense: float, experts: float, split: bool) -> float:
    """Seconds of a rank's DP collectives a step, an all-gather or reduce-scatter priced as half a ring all-reduce:
    zero=0 all-reduces (EP-split experts over dp/ep), zero=1 then gathers the stepped weights; over the shard group,
    zero=2 gathers once and reduce-scatters once, zero=3 gathers for every F and B and reduces every micro-batch (once
    a step on an I/W stage), each reduced shard then all-reduced over its replicas; FSDP calls once per layer."""
    bucket = cfg.parallel.bucket_mb * (1 << 20)
    expert_time = _dp_allreduce(costs, c.dp // c.ep, experts, bucket)
    if c.zero < 2:
        return (1.5 if c.zero else 1.0) * (_dp_allreduce(costs, c.dp, dense, bucket) + expert_time)
    shards, m = _state_shards(cfg, c)[0], c.n_microbatches
    layer = max(costs.layer_params * costs.param_bytes // c.tp, shards)  # FSDP's unit: one call per layer
    gathers, reduces = (2 * m, 1 if split else m) if c.zero == 3 else (1, 1)
    return ((gathers + reduces) / 2 * _dp_allreduce(costs, shards, dense, layer) + expert_time
            + reduces * _dp_allreduce(costs, c.dp // shards, dense / shards, layer // shards))


def after_pipeline(candidate: Candidate, cfg: DictConfig, costs: MeasuredCosts, rank_params: list[int],
                   tied_copy: bool, rank_experts: list[int], split: list[bool]) -> list[float]:
    """Seconds each pipeline rank spends after its last action: tied-embedding and DP collectives, then AdamW on its
    share. No overlap with the backward is assumed: with gloo on CPU the reduction competes with compute for the
    same cores; on NCCL only the last bucket (one bucket's time) stays exposed."""
    c, out = candidate, []
    bucket = cfg.parallel.bucket_mb * (1 << 20)
    dense_shards, expert_shards = _state_shards(cfg, c)
    for r, (held, experts) in enumerate(zip(rank_params, rank_experts)):
        dense_bytes, expert_bytes = (held - experts) * costs.param_bytes, experts * costs.param_bytes
        dp_time = _dp_sync(cfg, c, costs, dense_bytes, expert_bytes, split[r])
        if costs.key["backend"] == "nccl":
            dp_time = min(dp_time, _dp_sync(cfg, c, costs, min(dense_bytes + expert_bytes, bucket), 0, split[r]))
        pair = tied_copy and r in (0, c.pp - 1)  # the tied embedding's two copies
        tied = costs.allreduce.time(costs.embed_params * costs.param_bytes / c.tp) if pair else 0.0
        stepped = (held - experts) / dense_shards + experts / expert_shards
        out.append(dp_time + tied + stepped * costs.optimizer_s_per_param)
    return out


def _state_shards(cfg: DictConfig, c: Candidate) -> tuple[int, int]:
    """DP ranks sharing a dense and an EP-split expert parameter's AdamW state: at zero=1 the DP replicas (the
    experts' dp/ep); at 2 and 3 the dense one's shard group, dp / dp_replicate (dp / ep under EP), experts whole."""
    if c.zero < 2:
        return (c.dp, c.dp // c.ep) if c.zero else (1, 1)
    return c.dp // (c.ep if c.ep > 1 and c.dp > c.ep else cfg.parallel.dp_replicate), 1


def state_bytes_per_param(cfg: DictConfig, candidate: Candidate, param_bytes: int, split: bool) -> tuple[float, ...]:
    """Bytes a dense and an EP-split expert parameter hold on a rank's device at the step's fullest moment, and a dense
    one on the host: weight, gradient, AdamW's moments (zero=1 shards the moments, 3 all three, over `_state_shards`;
    2 and a `split` (I/W) stage hold the gathered weight (bf16 at mixed_precision_param=bf16) and the whole gradient
    beside the shards; cpu_offload puts the shards on the host; experts stay whole on the device at 2 and 3)."""
    dense, expert = _state_shards(cfg, candidate)
    if candidate.zero < 2:
        return *(2 * param_bytes + ADAMW_STATE_BYTES / n for n in (dense, expert)), 0
    whole, p = 2 * param_bytes + ADAMW_STATE_BYTES, cfg.parallel
    gathered = candidate.zero == 2 or split  # weights gathered beside the shards, gradients whole until the reduce
    in_step = gathered * ((2 if p.mixed_precision_param == "bf16" else param_bytes) + param_bytes)
    shards = (whole - gathered * param_bytes) / dense  # zero=3 reshards every micro-batch (one layer whole: left out)
    return (in_step, whole, whole / dense) if p.cpu_offload else (in_step + shards, whole, 0)


def predict(candidate: Candidate, cfg: DictConfig, costs: MeasuredCosts) -> Prediction:
    """Predicted step time (simulated pipeline + TP/EP/DP communication + optimizer) and peak bytes per rank."""
    config = model_config(cfg)
    pipeline = lowered_of(candidate, config.num_hidden_layers, cfg.schedule.get("path"))
    tied = bool(config.tie_word_embeddings)
    model = stage_model(candidate, pipeline, costs, tied, getattr(config, "num_experts_per_tok", 1) or 1)
    sim = pipeline.simulate(model.costs)
    c = candidate
    rank_params, rank_experts = ([sum(per_stage[s] for s in rank_stages(r, c.pp, c.vpp, pipeline.placement))
                                  for r in range(c.pp)] for per_stage in (model.params, model.experts))
    tied_copy = tied and c.pp > 1 and pipeline.placement != "v"
    split = [any(a.kind is I for a in actions) for actions in pipeline.lowered]
    post = after_pipeline(c, cfg, costs, rank_params, tied_copy, rank_experts, split)
    step = max(max(row, default=0.0) + extra for row, extra in zip(sim.end, post))
    state = [state_bytes_per_param(cfg, c, costs.param_bytes, s) for s in split]
    peaks = tuple(int((n - e) * dense + e * expert) + live_peak(actions, model.saved, model.deferred)
                  for n, e, (dense, expert, _), actions in zip(rank_params, rank_experts, state, pipeline.lowered))
    host = tuple(int((n - e) * offloaded) for n, e, (_, _, offloaded) in zip(rank_params, rank_experts, state))
    return Prediction(step_s=step, peak_bytes=peaks, sim=sim, host_bytes=host)
