"""Before launch: does the run fit this host's memory (or, on GPUs, each device's)? A 6.7B model on a 24 GB host
is one line with the figures, not an allocator error in every worker.

The figure per rank is the cost model's memory model (`training.layout_search.predict`: weights, gradients, AdamW state,
and the activations live at once under the schedule), fed with what is known without running the model: parameter
counts from the meta model and activation bytes from the family's closed formula (a cached measurement where the
family has none; else only the head's, so the figure stays a lower bound and never refuses a run that fits)."""

import os

from omegaconf import DictConfig, OmegaConf

from training.config.layout import layout_world_size, process_pp, resolved_dp
from parallel.expert import expert_modules
from training.config.schema import model_decoder
from training.layout_search.costs import MeasuredCosts, ADAMW_STATE_BYTES
from training.layout_search.profile import measured_costs
from training.specs import resolve_dtype
from parallel.grid import resolve_backend
from training.layout_search.predict import candidate_of, predict

GIB = 1 << 30
MASTER_BYTES = 4  # fp32 master weights, whatever the compute dtype (as the profiler measures them)


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
    device = torch.device("cuda") if _on_gpu(cfg) else torch.device("cpu")
    dtype_bytes = resolve_dtype(t.dtype, device).itemsize
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
    held = MASTER_BYTES if cfg.lora.rank > 0 else priced
    if OmegaConf.select(cfg, "train.task") == "dpo":
        held += MASTER_BYTES
    return held / priced


def _on_gpu(cfg: DictConfig) -> bool:
    """The workers compute on CUDA devices (the grid's own rule for parallel.backend)."""
    return resolve_backend(cfg.parallel.backend)[1].type == "cuda"


def per_rank_bytes(cfg: DictConfig, launched: int | None) -> dict[int, int]:
    """Predicted peak bytes of each process this host starts, by global rank (pipeline coordinate from the rank
    grid, TP fastest; under emulation one process holds every stage)."""
    world = layout_world_size(cfg, launched)
    dp = resolved_dp(cfg, launched)
    peaks = predict(candidate_of(cfg, dp=dp), cfg, estimated_costs(cfg)).peak_bytes
    if "LOCAL_WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun: this node's ranks only
        first = int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", 0))
        local = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    else:
        local = range(world)
    per_pp = cfg.parallel.tp * dp
    return {r: sum(peaks) if process_pp(cfg) == 1 else peaks[r // per_pp] for r in local}


def memory_problem(cfg: DictConfig, launched: int | None = None, this_host: bool = True) -> str | None:
    """One line when the run's predicted memory does not fit: the budget per rank (parallel.memory_budget_gb) when
    set, else (for a run on `this_host`) each GPU's memory, else the host's available memory for all its ranks
    together; None when it fits."""
    if cfg.parallel.layout == "auto":  # the layout search applies its own budget
        return None
    ranks = per_rank_bytes(cfg, launched)
    need = max(ranks.values())
    t = cfg.train
    params = sum(p.numel() for p in model_decoder(cfg).module.parameters()) / 1e9
    head = (f"the model (model={cfg.model.name}, {params:.3g}B parameters) needs about {need / GIB:.1f} GiB per rank "
            f"(weights, gradients, AdamW state, activations at train.micro_batch_size={t.micro_batch_size} x "
            f"train.seq_len={t.seq_len})")
    fixes = ("use a smaller model, more GPUs or hosts (parallel.tp/pp split the weights), parallel.zero=3 (with "
             "parallel.dp>=2: weights, gradients and AdamW state sharded over the DP ranks) or 1, "
             "train.recompute=full or a smaller train.micro_batch_size")
    budget = cfg.parallel.memory_budget_gb
    if budget is not None:
        return None if need <= budget * GIB else \
            f"{head} but parallel.memory_budget_gb={budget:g}; {fixes}, or raise the budget"
    if not this_host:  # another host's memory is unknown here
        return None
    override = "or set parallel.memory_budget_gb (GiB per rank) where this figure is wrong"
    if _on_gpu(cfg):
        import torch

        count = torch.cuda.device_count()
        for index, (rank, nbytes) in enumerate(sorted(ranks.items())):
            total = torch.cuda.get_device_properties(index % count).total_memory  # no CUDA context is created
            if nbytes > total:
                return f"{head} but rank {rank}'s GPU has {total / GIB:.1f} GiB; {fixes}, {override}"
        return None
    import psutil

    available, total = psutil.virtual_memory().available, sum(ranks.values())
    if total <= available:
        return None
    many = f"its {len(ranks)} ranks need {total / GIB:.1f} GiB together and " if len(ranks) > 1 else ""
    return f"{head} but {many}this host has {available / GIB:.1f} GiB available; {fixes}, {override}"
