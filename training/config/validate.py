"""validate(cfg): the whole pre-launch check. It reads files and writes none; it fills in the values other keys
derive (schedule.n_microbatches from train.global_batch_size, parallel.layers_per_stage=auto). Each key's own rule
sits beside it in the schema, applied by pydantic (`training.config.run_model`); this module holds the rules that
relate several keys.

One verb: a pre-launch check is `<what>_problem(...) -> str | None`, the one line naming what is wrong and the
fix, or None; `validate` (and `training.launch.cli.preflight` for what only the command line knows) collects
them in order and raises the first as ConfigError, the one place a check's line becomes an error. A `check_*`
raises: it guards a pass or a worker at run time (`check_tp_divisibility`, `check_expert_parallel`, ...), and a
`*_problem` here calls it on the meta model and returns its message. `*_warnings` return lines to print."""

import os
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from training.config.schema import model_config, model_keys, schema_keys, model_decoder
from training.config.run_model import out_of_scope, run_config_problem, scope_problem
from training.rules.values import ConfigError, shown
from training.config.layout import resolve_global_batch, resolved_dp
from training.config.layout_checks import experts_problem, model_split_problem, parallel_problem, zero_problem
from training.methods.grpo.checks import grpo_problem
from training.report.loggers import logger_problem
from training.layout_search.balance import resolve_auto_partition
from training.methods.lora import lora_targets, file_adapters, layer_linears
from checkpoint.errors import CheckpointError
from parallel.materialize import dense_shape
from training.data import DataError, data_problem, load_tokenizer_vocab_size, run_data_spec, weights_tokenizer_problem
from checkpoint.dense_shapes import shape_problem
from checkpoint.dense import check_dense_files
from training.config.output_paths import output_dir_problem


def resolvable_problem(cfg: DictConfig) -> str | None:
    """Every `${...}` interpolation resolves (else one line naming the key)."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        reason = str(error).strip().splitlines()[0]
        return f"{key}: cannot resolve its interpolation ({reason}); fix or drop the ${{...}}"
    return None


def model_problem(cfg: DictConfig) -> str | None:
    """The model section names a buildable model (a supported family, consistent fields), checked before launch;
    shape rules that would otherwise fail deep inside the first forward."""
    from models import ModelError  # every model family (seconds to import): only once a model is built

    try:
        c = model_config(cfg)
    except (ModelError, ValueError, TypeError) as error:
        return str(error).strip().splitlines()[0]
    heads, kv_heads, hidden = c.num_attention_heads, c.num_key_value_heads, c.hidden_size
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    if head_dim == hidden // heads and hidden % heads:  # a derived head_dim must split the hidden size exactly
        return (f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}; "
                "pick a head count that divides the hidden size")
    if heads % kv_heads:
        return (f"model.num_key_value_heads={kv_heads} must divide model.num_attention_heads={heads} "
                "(grouped-query attention)")
    if head_dim % 2:
        return (f"head_dim={head_dim} is odd; RoPE needs an even head_dim "
                "(change model.hidden_size or model.num_attention_heads)")
    experts = getattr(c, "num_experts", 0) or 0
    if getattr(c, "use_moe", experts > 0) and c.num_experts_per_tok > experts:
        return f"model.num_experts_per_tok={c.num_experts_per_tok} exceeds model.num_experts={experts}; lower it"
    return None


def train_problem(cfg: DictConfig) -> str | None:
    """Loop and optimizer rules across keys."""
    t, positions = cfg.train, model_config(cfg).max_position_embeddings
    if t.seq_len > positions:
        return (f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings={positions}; "
                "lower train.seq_len or raise the model's limit")
    if t.trace_step is not None and t.epochs is None and t.trace_step > t.steps:  # epochs: steps come later
        return (f"train.trace_step={t.trace_step} is after the last step (train.steps={t.steps}); "
                f"pick a step in 1..{t.steps}")
    if cfg.data.val_path is not None and cfg.data.val_fraction > 0:
        return "data.val_path and data.val_fraction both choose the validation split; set only one"
    if t.eval_every > 0 and cfg.data.val_path is None and cfg.data.val_fraction == 0:
        return (f"train.eval_every={t.eval_every} needs a held-out split; set data.val_fraction "
                "(e.g. 0.05) or data.val_path=<jsonl file>")
    return None


def train_warnings(cfg: DictConfig) -> list[str]:
    """Loop settings that are legal but probably unintended."""
    t, warnings = cfg.train, []
    if cfg.optim.warmup_steps > t.steps and t.epochs is None:
        warnings.append(f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run (train.steps={t.steps}): "
                        "the learning rate never reaches optim.lr")
    if cfg.data.val_fraction > 0 and t.eval_every == 0:
        warnings.append(f"data.val_fraction={cfg.data.val_fraction} holds data out of training, but train.eval_every=0 "
                        "never evaluates it; set train.eval_every or drop data.val_fraction")
    if t.trace_step is not None and cfg.parallel.pp == 1:
        warnings.append(f"train.trace_step={t.trace_step} traces the pipeline schedule, and parallel.pp=1 has none: "
                        "nothing is written")
    return warnings


def lora_problem(cfg: DictConfig) -> str | None:
    """lora.targets match at least one linear of the model's layers (the pass's own check, on the meta model)."""
    from training.specs import lora_spec  # DCP behind the checkpoint spec (seconds): only once a model is checked

    spec = lora_spec(cfg)
    if not spec.enabled:
        return None
    try:
        lora_targets(model_decoder(cfg), spec)
    except ValueError as error:
        return str(error).strip().splitlines()[0]
    return None


def lora_warnings(cfg: DictConfig) -> list[str]:
    """lora keys set while lora.rank=0 leaves them unread."""
    from training.specs import lora_spec  # DCP behind the checkpoint spec (seconds): only once a model is checked

    if lora_spec(cfg).enabled:
        return []
    unread = [k.name for k in schema_keys() if k.name.startswith("lora.") and k.name != "lora.rank"
              and OmegaConf.select(cfg, k.name) != k.default]
    return [f"{key}={shown(OmegaConf.select(cfg, key))} is read only when lora.rank>0 (here lora.rank=0); it is "
            "ignored" for key in unread]


def lora_init_problem(cfg: DictConfig) -> str | None:
    """lora.init exists, is a regular file (or a PEFT folder of them) and its adapters fit the linears lora.targets
    adapts in this model (the pass's own reading, on the whole meta model)."""
    from training.specs import lora_spec  # DCP behind the checkpoint spec (seconds): only once a model is checked

    spec = lora_spec(cfg)
    if not spec.enabled or spec.init is None:
        return None
    if not os.path.lexists(spec.init):
        return (f"lora.init={spec.init} does not exist; give a MiniMind LoRA .pth (scripts/export_hf.py "
                "RUN OUT --adapters-only --format pth writes one) or a PEFT adapter folder")
    decoder = model_decoder(cfg)
    shapes = {name: dense_shape(module.weight, 1) for name, module in layer_linears(decoder)}
    try:
        file_adapters(spec, shapes, set(lora_targets(decoder, spec)), whole=True)
    except CheckpointError as error:
        return str(error)
    return None


def data_tokenizer_problem(cfg: DictConfig, world_size: int | None = None) -> str | None:
    """Data source and files (the data module's own check), and the tokenizer's ids against the model's and against
    the tokenizer beside the initial weights."""
    dp = resolved_dp(cfg, world_size)
    if problem := data_problem(cfg, dp=dp) or (grpo_problem(cfg, dp) if cfg.train.task == "grpo" else None):
        return problem
    try:
        vocab = load_tokenizer_vocab_size(cfg)  # synthetic: data.vocab_size, known without training it
        problem = weights_tokenizer_problem(cfg.checkpoint.load_dense, run_data_spec(cfg))
    except DataError as error:
        return str(error)
    if problem:
        return problem
    model_vocab = model_config(cfg).vocab_size
    if vocab > model_vocab:
        return (f"the tokenizer has {vocab} tokens but model.vocab_size={model_vocab}; "
                f"set model.vocab_size>={vocab} or use a smaller tokenizer")
    return None


def dense_shape_problem(cfg: DictConfig, dense: str) -> str | None:
    """The dense weights' shapes (headers only) against the model's, built on the meta device."""
    decoder = model_decoder(cfg)
    return shape_problem(dense, {name: tuple(t.shape) for name, t in decoder.module.state_dict().items()},
                         decoder.plan.ties)


def checkpoint_problem(cfg: DictConfig) -> str | None:
    """A checkpoint to resume exists, is complete and readable, and was written for this model; a distillation
    teacher can teach it; LoRA's starting adapters (lora.init) fit; the folders the run writes (checkpoint.dir,
    data.cache_dir) can be created and written."""
    from checkpoint.manager import find_checkpoint, resume_problem  # DCP (seconds to import): a checkpoint only
    from models import config_record  # every model family (seconds to import): only once a model is built
    from training.methods.distill.teacher import teacher_problem  # reads the teacher's config (train.task=distill)
    from training.specs import lora_record  # DCP behind the checkpoint spec (seconds): only once a model is checked

    dense = cfg.checkpoint.load_dense
    if dense and Path(dense).is_dir() and find_checkpoint(Path(dense)) is not None:
        return (f"checkpoint.load_dense={dense} is a training checkpoint, not dense weights; continue it "
                f"with checkpoint.resume={dense}, or export it first (scripts/export_hf.py {dense} OUT) and load OUT")
    if dense:
        try:
            check_dense_files(dense)  # inside its folder, regular files: a FIFO would block every rank
        except CheckpointError as error:
            return str(error)
        if problem := dense_shape_problem(cfg, dense):
            return problem
    for key in ("checkpoint.dir", "data.cache_dir"):
        if (value := OmegaConf.select(cfg, key)) and (problem := output_dir_problem(value, key)):
            return problem
    resume = cfg.checkpoint.resume
    if resume not in (None, "auto", "none") and not Path(resume).exists():
        return (f"checkpoint.resume={resume} does not exist; give a checkpoint, a checkpoints folder or a "
                "run directory, or use checkpoint.resume=auto|none")
    return (resume_problem(resume, cfg.checkpoint.dir, config_record(model_config(cfg)), model_keys(),
                           lora_record(cfg), cfg.train.steps if cfg.train.epochs is None else None)
            or teacher_problem(cfg, model_config(cfg).vocab_size) or lora_init_problem(cfg))


def problems(cfg: DictConfig, world_size: int | None = None) -> Iterator[str | None]:
    """Every pre-launch check in order, each run only once the ones before it passed (later ones read what earlier
    ones vouch for); the values derived from other keys are filled in on the way."""
    yield resolvable_problem(cfg)
    yield run_config_problem(cfg)  # keys outside the schema, then each key's own rule
    yield scope_problem(cfg)  # a key set where another key's value leaves it unread
    yield model_problem(cfg)
    yield train_problem(cfg)
    yield logger_problem(cfg)  # wandb credentials and modes: the logger module's own rule
    yield parallel_problem(cfg, world_size)
    resolve_global_batch(cfg, world_size)
    resolve_auto_partition(cfg)  # parallel.layers_per_stage=auto -> the cost-balanced split
    yield model_split_problem(cfg)
    yield experts_problem(cfg, world_size)
    yield zero_problem(cfg, resolved_dp(cfg, world_size))
    yield lora_problem(cfg)
    yield data_tokenizer_problem(cfg, world_size)
    yield checkpoint_problem(cfg)


def validate(cfg: DictConfig, world_size: int | None = None) -> list[str]:
    """Raise ConfigError with one readable line for the first bad value in cfg; return the warnings."""
    for problem in problems(cfg, world_size):
        if problem:
            raise ConfigError(problem)
    harmless = [line for refused, line in out_of_scope(cfg) if not refused]  # ignored, said aloud
    return [*harmless, *train_warnings(cfg), *lora_warnings(cfg)]
