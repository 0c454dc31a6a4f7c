"""The run-config schema (registered with Hydra's ConfigStore) and validate(): one clear line per bad value."""

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@dataclass
class ModelSchema:
    """MiniMindConfig fields a run may set; `name` is the preset."""

    name: str = "minimind3"
    vocab_size: int = 6400
    hidden_size: int = 768
    intermediate_size: Optional[int] = None
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    dropout: float = 0.0
    use_moe: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 1
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 5e-4
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True


@dataclass
class ParallelSchema:
    """Layout: data, tensor and pipeline parallel sizes, virtual stages and runtime settings."""

    dp: Optional[int] = None
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    layers_per_stage: Optional[list[int]] = None
    backend: str = "auto"
    timeout_s: float = 300.0
    emulate: bool = False


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
    seq_len: int = 256
    seed: int = 42
    dtype: str = "auto"
    grad_clip: float = 1.0
    log_every: int = 10
    trace_step: Optional[int] = None


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


@dataclass
class CheckpointSchema:
    """Training checkpoints and dense-weight loading."""

    dir: Optional[str] = None
    every: int = 0
    keep_last: int = 3
    resume: Optional[str] = None
    load_dense: Optional[str] = None


@dataclass
class LoggerSchema:
    """Rank-0 metric sinks besides metrics.jsonl: tensorboard, wandb or none."""

    name: str = "tensorboard"
    project: str = "sluice"
    mode: str = "offline"


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


def register_schema() -> None:
    """Make `base_config` available to the defaults list of conf/config.yaml."""
    ConfigStore.instance().store(name="base_config", node=RunSchema)


class ConfigError(ValueError):
    """A bad run config; the message is one line naming the key and the fix."""


DTYPES = ("auto", "fp32", "bf16")
LOGGERS = ("tensorboard", "wandb", "none")
BACKENDS = ("auto", "gloo", "nccl")


def _positive(cfg: DictConfig, *keys: str) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value} must be positive; set {key} to a value > 0")


def _one_of(cfg: DictConfig, key: str, allowed: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    if value not in allowed:
        raise ConfigError(f"{key}={value} is not supported; use one of {', '.join(allowed)}")


def validate_model(cfg: DictConfig) -> None:
    """Model shape rules that would otherwise fail deep inside the first forward."""
    m = cfg.model
    _positive(cfg, "model.vocab_size", "model.hidden_size", "model.num_hidden_layers",
              "model.num_attention_heads", "model.num_key_value_heads", "model.max_position_embeddings",
              "model.intermediate_size", "model.num_experts", "model.num_experts_per_tok")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                          f"{m.num_attention_heads}; pick a head count that divides the hidden size")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(f"model.num_key_value_heads={m.num_key_value_heads} must divide model.num_attention_heads="
                          f"{m.num_attention_heads} (grouped-query attention)")
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(f"head_dim={m.hidden_size // m.num_attention_heads} is odd; RoPE needs an even head_dim "
                          "(change model.hidden_size or model.num_attention_heads)")
    if m.use_moe and m.num_experts_per_tok > m.num_experts:
        raise ConfigError(f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds model.num_experts="
                          f"{m.num_experts}; lower it")


def validate_train(cfg: DictConfig) -> None:
    """Loop, optimizer and logger settings."""
    _positive(cfg, "train.steps", "train.micro_batch_size", "train.seq_len", "train.log_every",
              "schedule.n_microbatches", "optim.lr", "optim.eps")
    _one_of(cfg, "train.dtype", DTYPES)
    _one_of(cfg, "logger.name", LOGGERS)
    if cfg.train.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_position_embeddings="
                          f"{cfg.model.max_position_embeddings}; lower train.seq_len or raise the model's limit")
    if cfg.train.grad_clip < 0:
        raise ConfigError(f"train.grad_clip={cfg.train.grad_clip} is negative; use 0 to disable clipping")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} is negative; use 0 for no warm-up")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must lie in [0, 1]")
    if cfg.optim.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={cfg.optim.weight_decay} is negative; use 0 or more")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)} must be two numbers in [0, 1)")


def validate_data(cfg: DictConfig) -> None:
    """Data source, files on disk and the tokenizer's vocabulary against the model's."""
    from training.data import check_data, load_tokenizer_vocab_size

    problem = check_data(cfg)  # names, formats, sizes and files: one check shared with the data loader
    if problem:
        raise ConfigError(problem)
    vocab = cfg.data.vocab_size if cfg.data.name == "synthetic" else load_tokenizer_vocab_size(cfg)
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}; "
                          f"set model.vocab_size>={vocab} or use a smaller tokenizer")


def validate_parallel(cfg: DictConfig, world_size: int | None = None) -> None:
    """Layout sizes; the deeper checks (heads, partition, schedule) live next to the code they protect."""
    _positive(cfg, "parallel.tp", "parallel.pp", "parallel.vpp", "parallel.dp", "parallel.timeout_s")
    _one_of(cfg, "parallel.backend", BACKENDS)
    p = cfg.parallel
    pp = 1 if p.emulate else p.pp  # emulation runs every pipeline rank inside one process
    if world_size is not None:
        if p.dp is None and world_size % (p.tp * pp):
            raise ConfigError(f"world size {world_size} is not a multiple of parallel.tp*pp = {p.tp}*{pp}; "
                              f"launch a multiple of {p.tp * pp} processes or change parallel.tp/pp")
        dp = p.dp or world_size // (p.tp * pp)
        if dp * p.tp * pp != world_size:
            raise ConfigError(f"world size {world_size} != parallel.dp*tp*pp = {dp}*{p.tp}*{pp}; "
                              f"launch {dp * p.tp * pp} processes or change the parallel sizes")


def validate_checkpoint(cfg: DictConfig) -> None:
    """Paths that must exist before anything starts."""
    from pathlib import Path

    path = cfg.checkpoint.load_dense
    if path is not None and not Path(path).exists():
        raise ConfigError(f"checkpoint.load_dense={path} does not exist; give an existing path or drop the override")
    # Training checkpoints (save, resume) are not built yet: refuse the keys instead of silently ignoring them.
    for key in ("dir", "resume"):
        if cfg.checkpoint[key] is not None:
            raise ConfigError(f"checkpoint.{key}: training checkpoints are not implemented yet; drop the override "
                              "(checkpoint.load_dense loads dense weights)")
    if cfg.checkpoint.every:
        raise ConfigError("checkpoint.every: training checkpoints are not implemented yet; drop the override")


def model_config(cfg: DictConfig):
    """MiniMindConfig from the run config's model section (the preset name is not a model field)."""
    from minimind import MiniMindConfig

    fields = OmegaConf.to_container(cfg.model, resolve=True)
    fields.pop("name", None)
    return MiniMindConfig(**fields)


def validate_layout(cfg: DictConfig) -> None:
    """TP divisibility, the stage partition and the schedule itself (lowered and simulated) before launch."""
    from parallel.pipeline.partition import layer_partition
    from parallel.pipeline.schedules import SCHEDULES
    from parallel.tensor import check_tp_divisibility

    p, name = cfg.parallel, cfg.schedule.name
    if name != "table":  # a table's own header names its pp, micro-batches and vpp; the loader checks them
        if name not in SCHEDULES:
            raise ConfigError(f"schedule.name={name} is not a known schedule; use one of "
                              f"{', '.join(sorted([*SCHEDULES, 'table']))}")
        spec = SCHEDULES[name]
        if spec.needs_vpp and p.vpp < 2:
            raise ConfigError(f"schedule={name} needs virtual stages; set parallel.vpp>=2")
        if not spec.needs_vpp and p.vpp != 1:
            raise ConfigError(f"schedule={name} runs one stage per rank but parallel.vpp={p.vpp}; "
                              "set parallel.vpp=1 or pick an interleaved schedule")
    try:
        check_tp_divisibility(model_config(cfg), p.tp)
        layer_partition(cfg.model.num_hidden_layers, p.pp * p.vpp,
                        list(p.layers_per_stage) if p.layers_per_stage is not None else None)
        if p.pp > 1:
            from parallel.pipeline.plan import plan_pipeline
            from training.specs import pipeline_spec

            plan_pipeline(pipeline_spec(cfg), cfg.model.num_hidden_layers)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def validate(cfg: DictConfig, world_size: int | None = None) -> None:
    """Raise ConfigError with one readable line for the first bad value in cfg."""
    validate_model(cfg)
    validate_train(cfg)
    validate_parallel(cfg, world_size)
    validate_layout(cfg)
    validate_data(cfg)
    validate_checkpoint(cfg)
