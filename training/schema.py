"""The run-config schema: every key a run may set, its type and its default (the one home of every default)."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # the config groups of `python train.py`
MIB = 1 << 20


@dataclass
class ModelSchema:
    """The model: a preset `name`, `hf_config` (a transformers config.json folder; none: MiniMind) and fields set on
    top of the family's defaults (null keeps the default: MiniMindConfig's, or the config.json's)."""

    name: str = "minimind3"
    hf_config: Optional[str] = None
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    rms_norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    dropout: Optional[float] = None
    use_moe: Optional[bool] = None
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: Optional[bool] = None
    router_aux_loss_coef: Optional[float] = None
    initializer_range: Optional[float] = None
    tie_word_embeddings: Optional[bool] = None


@dataclass
class ParallelSchema:
    """Layout: data, tensor and pipeline parallel sizes, virtual stages and runtime settings."""

    dp: Optional[int] = None
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    layers_per_stage: Any = None  # null (even), a list of layer counts per stage, or auto
    backend: str = "auto"
    timeout_s: float = 300.0
    startup_timeout_s: float = 600.0
    emulate: bool = False
    zero: int = 0
    bucket_mb: float = 25.0
    transport: str = "auto"
    plan: Optional[str] = None
    memory_budget_gb: Optional[float] = None


@dataclass
class ScheduleSchema:
    """Pipeline schedule by name (or a table file) and micro-batches per step."""

    name: str = "1f1b"
    n_microbatches: int = 4
    path: Optional[str] = None


@dataclass
class TrainSchema:
    """Loop settings: steps, batch geometry, seed, precision, clipping, logging cadence."""

    steps: int = 1000
    micro_batch_size: int = 8
    global_batch_size: Optional[int] = None
    seq_len: int = 256
    seed: int = 42
    dtype: str = "auto"
    grad_clip: float = 1.0
    log_every: int = 10
    trace_step: Optional[int] = None
    recompute: str = "none"
    eval_every: int = 0
    eval_batches: int = 10
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 3
    max_restarts: int = 0
    peak_tflops: Optional[float] = None


@dataclass
class OptimSchema:
    """AdamW with linear warm-up then cosine decay to min_lr_ratio * lr."""

    name: str = "adamw"
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 100


@dataclass
class DataSchema:
    """Where training text comes from and how it becomes fixed-length samples."""

    name: str = "synthetic"
    path: Optional[str] = None
    tokenizer: Optional[str] = None
    format: str = "packed"
    num_docs: int = 4000
    seed: int = 0
    vocab_size: int = 2048
    cache_dir: str = ".cache/sluice"
    val_path: Optional[str] = None
    val_fraction: float = 0.0
    skip_bad_lines: bool = False
    max_line_bytes: int = 4 * MIB


@dataclass
class CheckpointSchema:
    """Training checkpoints and dense-weight loading."""

    dir: Optional[str] = None
    every: int = 0
    keep_last: int = 3
    resume: Optional[str] = None
    save_final: bool = True
    load_dense: Optional[str] = None


@dataclass
class LoggerSchema:
    """Rank-0 metric sinks besides metrics.jsonl; `name` is the preset, `backends` the sinks it writes."""

    name: str = "tensorboard"
    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "sluice"
    mode: str = "offline"


@dataclass
class DebugSchema:
    """Rehearsal switches: `fault` injects a stall, crash or NaN (`stall@rank=1,step=3`)."""

    fault: Optional[str] = None


@dataclass
class RunSchema:
    """The whole run config."""

    model: ModelSchema = field(default_factory=ModelSchema)
    parallel: ParallelSchema = field(default_factory=ParallelSchema)
    schedule: ScheduleSchema = field(default_factory=ScheduleSchema)
    train: TrainSchema = field(default_factory=TrainSchema)
    optim: OptimSchema = field(default_factory=OptimSchema)
    data: DataSchema = field(default_factory=DataSchema)
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)
    debug: DebugSchema = field(default_factory=DebugSchema)


def register_schema() -> None:
    """Make `base_config` available to the defaults list of conf/config.yaml."""
    ConfigStore.instance().store(name="base_config", node=RunSchema)


def model_config(cfg: Any):
    """The transformers config of the run's model section (MiniMind's, or the family of `model.hf_config`)."""
    from omegaconf import OmegaConf

    from models import model_config as resolve

    return resolve(OmegaConf.to_container(cfg.model, resolve=True))


def model_decoder(cfg: Any):
    """The run's dense model on the meta device (shapes only, no memory), as a `parallel.decoder.Decoder`."""
    from models import build_model, decoder_of

    return decoder_of(build_model(model_config(cfg)))


def model_keys() -> tuple[str, ...]:
    """The model fields a run may set (the schema's model section, the preset name aside)."""
    return tuple(f.name for f in dataclasses.fields(ModelSchema) if f.name != "name")


def schema_defaults(node: Any = RunSchema, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the schema ("train.steps") with its default value, in declaration order."""
    leaves: dict[str, Any] = {}
    instance = node() if isinstance(node, type) else node
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            leaves.update(schema_defaults(value, f"{prefix}{f.name}."))
        else:
            leaves[f"{prefix}{f.name}"] = value
    return leaves


def schema_sections() -> tuple[str, ...]:
    """The top-level sections of the run config ("model", "parallel", ...)."""
    return tuple(f.name for f in dataclasses.fields(RunSchema))
