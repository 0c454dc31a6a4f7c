"""From the run config to the typed specs the parallel layer takes: the only place that reads both."""

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from checkpoint.manager import CheckpointSpec
from parallel.fsdp import LEVELS
from parallel.spec import EngineSpec, PipelineSpec, ShardSpec
from parallel.step import Objective
from training.config.schema import model_keys, schema_defaults, model_config
from training.methods.lora import LoraSpec
from training.objectives.dpo import PreferenceLoss
from training.methods.grpo.objective import GroupPolicyLoss
from training.objectives.lm import LANGUAGE_MODEL
from models import config_record
from checkpoint.stage_weights import OUT, write_stage_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pipeline_spec(cfg: DictConfig) -> PipelineSpec:
    """The pipeline the config asks for (a schedule from a module is named by its `package.module:function`)."""
    p, s = cfg.parallel, cfg.schedule
    layers = tuple(p.layers_per_stage) if p.layers_per_stage is not None else None
    return PipelineSpec(pp=p.pp, vpp=p.vpp, schedule=s.get("module") or s.name, n_microbatches=s.n_microbatches,
                        table_path=s.get("path"), layers_per_stage=layers)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Compute dtype: `auto` is bf16 on CUDA and fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def lora_spec(cfg: DictConfig) -> LoraSpec:
    """The adapters the config asks for (`lora.*`; the initial lora_A drawn from train.seed, or lora.init's file)."""
    lora = cfg.lora
    targets = tuple(lora.targets) if lora.targets is not None else None
    return LoraSpec(rank=int(lora.rank), alpha=None if lora.alpha is None else float(lora.alpha), targets=targets,
                    dropout=float(lora.dropout), seed=int(cfg.train.seed), init=lora.get("init"))


def own_passes(cfg: DictConfig) -> tuple[LoraSpec, ...]:
    """The chunk passes this run adds to the engine's built-in ones: LoRA's adapters when lora.rank > 0."""
    spec = lora_spec(cfg)
    return (spec,) if spec.enabled else ()


def lora_record(cfg: DictConfig) -> dict | None:
    """What a checkpoint records of the adapters (checked on resume, read by the export), or None without LoRA."""
    spec = lora_spec(cfg)
    if not spec.enabled:
        return None
    return {"rank": spec.rank, "alpha": spec.alpha if spec.alpha is not None else float(spec.rank),
            "targets": list(spec.targets) if spec.targets is not None else None, "dropout": spec.dropout,
            "base": cfg.checkpoint.load_dense}


def objective(cfg: DictConfig) -> Objective:
    """What the last stage computes (train.task): the LM loss (pretrain, sft), the DPO loss over pairs (dpo), or
    the GRPO / CISPO loss over sampled completions (grpo)."""
    if OmegaConf.select(cfg, "train.task") == "dpo":
        return PreferenceLoss(beta=float(cfg.dpo.beta))
    if OmegaConf.select(cfg, "train.task") == "grpo":
        g = cfg.grpo
        return GroupPolicyLoss(loss_type=str(g.loss_type), beta=float(g.beta), epsilon=float(g.epsilon),
                               epsilon_high=float(g.epsilon_high), num_generations=int(g.num_generations))
    return LANGUAGE_MODEL


# EngineSpec's runtime settings and the run-config keys they come from.
ENGINE_KEYS = {"timeout_s": "parallel.timeout_s", "emulate": "parallel.emulate", "bucket_mb": "parallel.bucket_mb",
               "recompute": "train.recompute", "transport": "parallel.transport", "compile": "train.compile"}


def shard_spec(cfg: DictConfig) -> ShardSpec | None:
    """parallel.zero=2/3 (FSDP over the DP ranks, HSDP with parallel.dp_replicate); None at zero 0 and 1."""
    p = cfg.parallel
    return (ShardSpec(p.zero, p.dp_replicate, DTYPES[p.mixed_precision_param], p.cpu_offload) if p.zero in LEVELS
            else None)


def engine_spec(cfg: DictConfig, device: torch.device) -> EngineSpec:
    """Everything the step engine of this run needs, resolved for the compute device."""
    return EngineSpec(pipeline=pipeline_spec(cfg), micro_batch_size=cfg.train.micro_batch_size,
                      seq_len=cfg.train.seq_len, dtype=resolve_dtype(cfg.train.dtype, device), passes=own_passes(cfg),
                      objective=objective(cfg), shard=shard_spec(cfg),
                      **{field: OmegaConf.select(cfg, key) for field, key in ENGINE_KEYS.items()})


def default_engine_spec(pipeline: PipelineSpec, micro_batch_size: int, seq_len: int, **changes: Any) -> EngineSpec:
    """An EngineSpec with the schema's defaults for every runtime setting but `changes` (benchmarks and tests)."""
    defaults = schema_defaults()
    settings = {field: defaults[key] for field, key in ENGINE_KEYS.items()}
    settings["dtype"] = resolve_dtype(defaults["train.dtype"], torch.device("cpu"))
    settings["passes"] = ()  # lora.rank defaults to 0: no adapters
    settings["objective"] = LANGUAGE_MODEL
    settings["shard"] = None  # parallel.zero defaults to 0: whole parameters
    return EngineSpec(pipeline, micro_batch_size, seq_len, **{**settings, **changes})


def checkpoint_spec(cfg: DictConfig, run_dir: Path) -> CheckpointSpec:
    """Where and when this run saves and what it resumes; the folder defaults to `<run dir>/checkpoints`."""
    c = cfg.checkpoint
    return CheckpointSpec(dir=Path(c.dir) if c.dir else Path(run_dir) / "checkpoints", every=int(c.every),
                          keep_last=int(c.keep_last), resume=c.resume or "none",
                          save_final=bool(c.save_final), model_keys=model_keys(), run_dir=Path(run_dir))


def checkpoint_meta(cfg: DictConfig, grid) -> dict:
    """What a checkpoint records besides tensors: the model (checked on resume) and the writing layout."""
    model = config_record(model_config(cfg))
    p = cfg.parallel
    layout = {"dp": grid.dp, "tp": p.tp, "pp": p.pp, "ep": p.ep, "vpp": p.vpp, "schedule": cfg.schedule.name,
              "n_microbatches": cfg.schedule.n_microbatches, "micro_batch_size": cfg.train.micro_batch_size}
    meta = {"model": model, "layout": layout, "task": str(cfg.train.task)}
    if (lora := lora_record(cfg)) is not None:
        meta["lora"] = lora
    return meta


def stage_weights(cfg: DictConfig, run_dir: Path) -> Callable[[Path], Path] | None:
    """What a run with checkpoint.export_pth=true calls after each save: MiniMind's stage weights into
    `<run dir>/out/` (checkpoint.stage_weights), else None."""
    return partial(write_stage_weights, out_dir=Path(run_dir) / OUT) if cfg.checkpoint.export_pth else None
