"""The pre-launch checks of a layout: its sizes against each other, the device and the world size; the model split
over it (TP divisibility, the pipeline lowered and verified); expert parallelism; sharded data parallelism (ZeRO,
FSDP, HSDP). The pre-launch check (training/config/validate.py) runs them on the run config, the layout search on each
candidate."""

import torch
from omegaconf import DictConfig

from parallel.expert import check_expert_parallel
from parallel.grid import resolve_backend
from parallel.pipeline.lowered import lower_pipeline
from parallel.pipeline.partition import layer_partition
from parallel.tensor_pass import check_tp_divisibility
from training.config.layout import layout_world_size, resolved_dp
from training.config.schema import model_config, model_decoder
from training.rules.values import ConfigError


def parallel_problem(cfg: DictConfig, world_size: int | None = None) -> str | None:
    """Layout sizes against each other, the device and the launcher's world size."""
    p = cfg.parallel
    if p.vpp > 1 and p.pp == 1:
        return f"parallel.vpp={p.vpp} needs a pipeline; set parallel.pp>=2 or parallel.vpp=1"
    if p.backend == "nccl" and not torch.cuda.is_available():
        return "parallel.backend=nccl needs CUDA GPUs and none is visible; use parallel.backend=auto or gloo"
    if p.transport == "shm" and resolve_backend(p.backend)[1].type != "cpu":
        return (f"parallel.transport=shm carries CPU tensors, but parallel.backend={p.backend} computes "
                "on CUDA; use parallel.transport=auto (NCCL's P2P on GPUs) or parallel.backend=gloo")
    if world_size is not None:
        try:
            layout_world_size(cfg, world_size)
        except ConfigError as error:
            return str(error)
    return None


def model_split_problem(cfg: DictConfig) -> str | None:
    """TP divisibility, then the pipeline lowered (partition, schedule, vpp; lowered and verified) before launch."""
    from training.specs import pipeline_spec  # DCP behind the checkpoint spec (seconds): only once a model is checked

    p = cfg.parallel
    config = model_config(cfg)
    try:
        check_tp_divisibility(model_decoder(cfg).adapter.tp_sizes(), p.tp)  # meta: shapes only
        if p.pp > 1:  # lower_pipeline is the one home of schedule/vpp/partition rules
            lower_pipeline(pipeline_spec(cfg), config.num_hidden_layers)
        else:
            layer_partition(config.num_hidden_layers, 1,
                            list(p.layers_per_stage) if p.layers_per_stage is not None else None)
    except ValueError as error:
        return str(error).strip().splitlines()[0]
    return None


def experts_problem(cfg: DictConfig, world_size: int | None = None) -> str | None:
    """parallel.ep against the model's experts and the DP size (the EP pass's own check, on the meta model)."""
    if cfg.parallel.ep == 1:
        return None
    try:
        check_expert_parallel(model_decoder(cfg), resolved_dp(cfg, world_size), cfg.parallel.ep)
    except ValueError as error:
        return str(error).strip().splitlines()[0]
    return None


def zero_problem(cfg: DictConfig, dp: int) -> str | None:
    """Why `parallel.zero` / `parallel.dp_replicate` cannot run at the data-parallel size `dp`, or None."""
    p = cfg.parallel
    zero, replicate, ep = p.zero, p.dp_replicate, p.ep
    if zero < 2:  # dp_replicate, mixed_precision_param and cpu_offload are refused then by their scope (the schema)
        return None
    if dp == 1:
        return (f"parallel.zero={zero} shards over the data-parallel ranks and this layout has one (dp=1): nothing "
                "to shard; use parallel.zero=0, or parallel.dp>=2 (with that many more workers)")
    if p.cpu_offload and resolve_backend(p.backend)[1].type != "cuda":
        return (f"parallel.cpu_offload=true needs CUDA (shards in CPU memory, gathered to the GPU that computes), but "
                f"parallel.backend={p.backend} computes on the CPU here; set parallel.cpu_offload=false")
    if dp % replicate:
        choices = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        return (f"parallel.dp_replicate={replicate} does not divide the data-parallel size {dp}; choose one of "
                f"{{{choices}}}")
    if replicate == dp:
        return (f"parallel.dp_replicate={replicate} leaves one rank per shard group (dp={dp}): nothing to shard; "
                f"use a dp_replicate below {dp}, or parallel.zero=0 (plain data parallelism)")
    if ep > 1 and replicate > 1:
        return (f"parallel.dp_replicate={replicate} with parallel.ep={ep}: under EP the dense weights already "
                "replicate over the ep group and shard over the ranks holding the same experts; set "
                "parallel.dp_replicate=1")
    return None
