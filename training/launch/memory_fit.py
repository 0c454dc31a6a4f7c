"""Before launch: does the run fit this host's memory (or, on GPUs, each device's)? A 6.7B model on a 24 GB host
is one line with the figures, not an allocator error in every worker.

The figure per rank is the cost model's memory model (`training.layout_search.predict`: weights, gradients, AdamW state,
and the activations live at once under the schedule), fed with what is known without running the model: parameter
counts from the meta model and activation bytes from the family's closed formula (a cached measurement where the
family has none; else only the head's, so the figure stays a lower bound and never refuses a run that fits)."""

import os

import psutil
from omegaconf import DictConfig, OmegaConf

from training.config.layout import layout_world_size, process_pp, resolved_dp
from training.config.layout_checks import zero_problem
from training.config.run_model import scope_problem
from parallel.expert import expert_modules
from training.config.schema import model_decoder
from training.layout_search.costs import MeasuredCosts, ADAMW_STATE_BYTES
from training.layout_search.profile import measured_costs
from training.specs import resolve_dtype
from parallel.grid import resolve_backend
from training.layout_search.predict import candidate_of, predict

GIB = 1 << 30
MASTER_BYTES = 4  # fp32 master weights, whatever the compute dtype (as the profiler measures them)
ZERO_FIX = "parallel.zero=3 (with parallel.dp>=2: weights, gradients and AdamW state sharded over the DP ranks) or 1, "


def estimated_costs(cfg: DictConfig):
    """The inputs of the cost model's memory model known before launch; times are zero, only bytes are asked."""
    import torch

    decoder = model_decoder(cfg)  # meta device: shapes only, any size
    config, t, mode = decoder.config, cfg.train, cfg.train.recompute
    pieces = {"embedding": 0, "layer": 0, "final": 0, "head": 0}
    for name, param in decoder.module.named_parameters():  # a tied head is the embedding: counted once
        pieces[decoder.plan.piece_of(name)[0]] += param.numel()
    layers = config.num_hidden_layers
    experts = sum(p.numel() for _, m in expert_modules(decoder) for p in m.parameters()) // layers
    dtype_bytes = resolve_dtype(t.dtype, torch.device("cuda" if _on_gpu(cfg) else "cpu")).itemsize
    tokens = t.micro_batch_size * t.seq_len
    saved = decoder.adapter.saved_bytes_per_layer(t.micro_batch_size, t.seq_len, dtype_bytes, mode)
    if saved is None and (cached := measured_costs(cfg, cached_only=True)) is not None:
        saved = int(cached.layer_saved[mode] * t.micro_batch_size / cached.key["micro_batch_size"])
    scale = _state_scale(cfg)
    # head_saved: the final norm's fp32 input and the fp32 log-probabilities the loss keeps for its backward;
    # layer_deferred 0: the zero-bubble schedules' W deferral is left out (a lower bound again).
    return MeasuredCosts(
        key={"micro_batch_size": t.micro_batch_size, "backend": "gloo"}, layer_f=0.0, layer_b={mode: 0.0},
        layer_i={mode: 0.0}, layer_w=0.0, embed_f=0.0, embed_b=0.0, embed_i=0.0, embed_w=0.0, head_f=0.0,
        head_b=0.0, head_i=0.0, head_w=0.0, layer_saved={mode: saved or 0}, layer_deferred=0, embed_saved=0,
        embed_deferred=0, head_saved=tokens * 4 * (config.hidden_size + config.vocab_size), head_deferred=0,
        layer_params=int(pieces["layer"] // layers * scale), embed_params=int(pieces["embedding"] * scale),
        head_params=int((pieces["final"] + pieces["head"]) * scale), param_bytes=MASTER_BYTES,
        optimizer_s_per_param=0.0, boundary_bytes=tokens * config.hidden_size * 4,
        layer_expert_params=int(experts * scale))


def _state_scale(cfg: DictConfig) -> float:
    """Bytes a parameter really costs over the 16 the memory model prices (weight, gradient, AdamW's two moments):
    under LoRA the base weights have no gradient or optimizer state; DPO keeps a frozen reference copy."""
    priced = 2 * MASTER_BYTES + ADAMW_STATE_BYTES
    dpo = OmegaConf.select(cfg, "train.task") == "dpo"
    held = (MASTER_BYTES if cfg.lora.rank > 0 else priced) + MASTER_BYTES * dpo
    return held / priced


def _on_gpu(cfg: DictConfig) -> bool:
    """The workers compute on CUDA devices (the grid's own rule for parallel.backend)."""
    return resolve_backend(cfg.parallel.backend)[1].type == "cuda"


def per_rank_bytes(cfg: DictConfig, launched: int | None, host: bool = False) -> dict[int, int]:
    """Predicted peak bytes of each process this host starts, by global rank (pipeline coordinate from the rank
    grid, TP fastest; under emulation one process holds every stage); `host`: those parallel.cpu_offload pins there."""
    world, dp = layout_world_size(cfg, launched), resolved_dp(cfg, launched)
    prediction = predict(candidate_of(cfg, dp=dp), cfg, estimated_costs(cfg))
    peaks = prediction.host_bytes if host else prediction.peak_bytes
    if "LOCAL_WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun: this node's ranks only
        first = int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", 0))
        local = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    else:
        local = range(world)
    per_pp = cfg.parallel.tp * dp
    return {r: sum(peaks) if process_pp(cfg) == 1 else peaks[r // per_pp] for r in local}


def memory_problem(cfg: DictConfig, launched: int | None = None, this_host: bool = True) -> str | None:
    """One line when the run's predicted memory does not fit (`_shortfall`), naming at dp >= 2 the lowest other
    parallel.zero level that fits this layout, else the one that comes closest, with its figure; None when it fits."""
    if cfg.parallel.layout == "auto":  # the layout search applies its own budget
        return None
    ranks = per_rank_bytes(cfg, launched)
    if (short := _shortfall(cfg, launched, ranks, this_host)) is None:
        return None
    need, t = max(ranks.values()), cfg.train
    params = sum(p.numel() for p in model_decoder(cfg).module.parameters()) / 1e9
    level = _other_zero(cfg, launched, this_host, need)
    tail = "or raise the budget" if cfg.parallel.memory_budget_gb is not None else \
        "or set parallel.memory_budget_gb (GiB per rank) where this figure is wrong"
    return (f"the model (model={cfg.model.name}, {params:.3g}B parameters) needs about {need / GIB:.1f} GiB per rank "
            f"(weights, gradients, AdamW state, activations at train.micro_batch_size={t.micro_batch_size} x "
            f"train.seq_len={t.seq_len}) but {short}; {level or ''}use a smaller model, more GPUs or hosts "
            f"(parallel.tp/pp split the weights), {ZERO_FIX if level is None else ''}train.recompute=full or a smaller "
            f"train.micro_batch_size, {tail}")


def _shortfall(cfg: DictConfig, launched: int | None, ranks: dict[int, int], this_host: bool) -> str | None:
    """What this host's `ranks` exceed, or None: parallel.memory_budget_gb per rank when set, else (on `this_host`) each
    GPU's memory and the host's for what parallel.cpu_offload pins there, else the host's for all its ranks together."""
    if (budget := cfg.parallel.memory_budget_gb) is not None:
        return None if max(ranks.values()) <= budget * GIB else f"parallel.memory_budget_gb={budget:g}"
    if not this_host:  # another host's memory is unknown here
        return None
    if gpu := _on_gpu(cfg):
        import torch

        count = torch.cuda.device_count()
        for index, (rank, nbytes) in enumerate(sorted(ranks.items())):
            total = torch.cuda.get_device_properties(index % count).total_memory  # no CUDA context is created
            if nbytes > total:
                return f"rank {rank}'s GPU has {total / GIB:.1f} GiB"
        ranks = per_rank_bytes(cfg, launched, host=True) if cfg.parallel.cpu_offload else {}
    if (total := sum(ranks.values())) <= (available := psutil.virtual_memory().available):
        return None
    many = f"its {len(ranks)} ranks need {total / GIB:.1f} GiB together and " if len(ranks) > 1 else ""
    pinned = f"its ranks pin {total / GIB:.1f} GiB of host memory (parallel.cpu_offload=true) and "
    return f"{pinned if gpu else many}this host has {available / GIB:.1f} GiB available"


def _other_zero(cfg: DictConfig, launched: int | None, this_host: bool, need: int) -> str | None:
    """The lowest other valid parallel.zero level that fits, else the closest below `need`, or ''; None at dp=1."""
    dp, closest = resolved_dp(cfg, launched), None
    for level in range(4) if dp > 1 else ():
        other = OmegaConf.merge(cfg, {"parallel": {"zero": level}})
        if level == cfg.parallel.zero or zero_problem(other, dp) or scope_problem(other):  # bf16, HSDP, offload: 2/3
            continue
        peak = max((ranks := per_rank_bytes(other, launched)).values())
        if _shortfall(other, launched, ranks, this_host) is None:
            return f"parallel.zero={level} would need {peak / GIB:.1f} GiB per rank and fit, or "
        if peak < need:
            need, closest = peak, level
    return ("" if dp > 1 else None) if closest is None else \
        f"parallel.zero={closest} alone would still need {need / GIB:.1f} GiB per rank; "
