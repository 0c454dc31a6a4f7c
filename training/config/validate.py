"""validate(cfg): the whole pre-launch check. It reads files and writes none; it fills in the values other keys
derive (schedule.n_microbatches from train.global_batch_size, parallel.layers_per_stage=auto). Each key's own rule
sits beside it in the schema; this module applies those and holds the rules that relate several keys."""

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from training.config.schema import model_config, model_keys, schema_keys
from training.config.unknown_keys import check_known_keys
from training.config.values import ConfigError, shown
from training.config.layout import layout_world_size, resolve_global_batch, resolved_dp
from training.report.loggers import check_logger


def check_resolvable(cfg: DictConfig) -> None:
    """Every `${...}` interpolation resolves (else one line naming the key)."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(f"{key}: cannot resolve its interpolation ({reason}); fix or drop the ${{...}}") from None


def check_keys(cfg: DictConfig) -> list[str]:
    """Raise ConfigError for the first key that breaks its schema rule or is set outside its scope; return warnings
    for harmless out-of-scope keys."""
    keys = schema_keys()
    for key in keys:
        if problem := key.rule(key.name, OmegaConf.select(cfg, key.name)):
            raise ConfigError(problem)
    warnings = []
    for key in (k for k in keys if k.read_when):
        scope, value = key.read_when, OmegaConf.select(cfg, key.name)
        state = OmegaConf.select(cfg, scope.switch)
        if state not in scope.values and value != key.default:
            problem = (f"{key.name}={shown(value)} is read only when {scope.switch}="
                       f"{'|'.join(map(str, scope.values))} (here {scope.switch}={state})")
            if scope.refuse:
                raise ConfigError(f"{problem}; drop {key.name} or change {scope.switch}")
            warnings.append(f"{problem}; it is ignored")
    return warnings


def validate_model(cfg: DictConfig) -> None:
    """The model section names a buildable model (a supported family, consistent fields), checked before launch;
    shape rules that would otherwise fail deep inside the first forward."""
    from models import ModelError

    try:
        c = model_config(cfg)
    except (ModelError, ValueError, TypeError) as error:
        raise ConfigError(str(error).strip().splitlines()[0]) from None
    heads, kv_heads, hidden = c.num_attention_heads, c.num_key_value_heads, c.hidden_size
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    if head_dim == hidden // heads and hidden % heads:  # a derived head_dim must split the hidden size exactly
        raise ConfigError(f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}; "
                          "pick a head count that divides the hidden size")
    if heads % kv_heads:
        raise ConfigError(f"model.num_key_value_heads={kv_heads} must divide model.num_attention_heads={heads} "
                          "(grouped-query attention)")
    if head_dim % 2:
        raise ConfigError(f"head_dim={head_dim} is odd; RoPE needs an even head_dim "
                          "(change model.hidden_size or model.num_attention_heads)")
    experts = getattr(c, "num_experts", 0) or 0
    if getattr(c, "use_moe", experts > 0) and c.num_experts_per_tok > experts:
        raise ConfigError(f"model.num_experts_per_tok={c.num_experts_per_tok} exceeds model.num_experts="
                          f"{experts}; lower it")


def validate_train(cfg: DictConfig) -> list[str]:
    """Loop and optimizer rules across keys; returns warnings (legal but probably unintended)."""
    t, positions = cfg.train, model_config(cfg).max_position_embeddings
    if t.seq_len > positions:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings={positions}; "
                          "lower train.seq_len or raise the model's limit")
    if t.trace_step is not None and t.trace_step > t.steps:
        raise ConfigError(f"train.trace_step={t.trace_step} is after the last step (train.steps={t.steps}); "
                          f"pick a step in 1..{t.steps}")
    if cfg.data.val_path is not None and cfg.data.val_fraction > 0:
        raise ConfigError("data.val_path and data.val_fraction both choose the validation split; set only one")
    if t.eval_every > 0 and cfg.data.val_path is None and cfg.data.val_fraction == 0:
        raise ConfigError(f"train.eval_every={t.eval_every} needs a held-out split; set data.val_fraction "
                          "(e.g. 0.05) or data.val_path=<jsonl file>")
    warnings = []
    if cfg.optim.warmup_steps > t.steps:
        warnings.append(f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run (train.steps={t.steps}): "
                        "the learning rate never reaches optim.lr")
    if cfg.data.val_fraction > 0 and t.eval_every == 0:
        warnings.append(f"data.val_fraction={cfg.data.val_fraction} holds data out of training, but train.eval_every=0 "
                        "never evaluates it; set train.eval_every or drop data.val_fraction")
    if t.trace_step is not None and cfg.parallel.pp == 1:
        warnings.append(f"train.trace_step={t.trace_step} traces the pipeline schedule, and parallel.pp=1 has none: "
                        "nothing is written")
    return warnings


def validate_parallel(cfg: DictConfig, world_size: int | None = None) -> None:
    """Layout sizes against each other, the device and the launcher's world size."""
    p = cfg.parallel
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} needs a pipeline; set parallel.pp>=2 or parallel.vpp=1")
    if p.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("parallel.backend=nccl needs CUDA GPUs and none is visible; use parallel.backend=auto "
                              "or gloo")
    if p.transport == "shm":
        from parallel.grid import resolve_backend

        if resolve_backend(p.backend)[1].type != "cpu":
            raise ConfigError(f"parallel.transport=shm carries CPU tensors, but parallel.backend={p.backend} computes "
                              "on CUDA; use parallel.transport=auto (NCCL's P2P on GPUs) or parallel.backend=gloo")
    if world_size is not None:
        layout_world_size(cfg, world_size)


def resolve_partition(cfg: DictConfig) -> None:
    """parallel.layers_per_stage=auto -> the cost-balanced split (the cost model's; imported only when asked)."""
    if cfg.parallel.layers_per_stage == "auto":
        from training.layout_search.balance import resolve_auto_partition

        resolve_auto_partition(cfg)


def validate_layout(cfg: DictConfig) -> None:
    """TP divisibility, then the pipeline lowered (partition, schedule, vpp; lowered and verified) before launch."""
    from models import build_model, decoder_of
    from parallel.pipeline.partition import layer_partition
    from parallel.pipeline.lowered import lower_pipeline
    from parallel.tensor_pass import check_tp_divisibility
    from training.specs import pipeline_spec

    p = cfg.parallel
    config = model_config(cfg)
    try:
        check_tp_divisibility(decoder_of(build_model(config)).adapter.tp_sizes(), p.tp)  # meta: shapes only
        if p.pp > 1:  # lower_pipeline is the one home of schedule/vpp/partition rules
            lower_pipeline(pipeline_spec(cfg), config.num_hidden_layers)
        else:
            layer_partition(config.num_hidden_layers, 1,
                            list(p.layers_per_stage) if p.layers_per_stage is not None else None)
    except ValueError as error:
        raise ConfigError(str(error).strip().splitlines()[0]) from None


def validate_experts(cfg: DictConfig, world_size: int | None = None) -> None:
    """parallel.ep against the model's experts and the DP size (the EP pass's own check, on the meta model)."""
    from models import build_model, decoder_of
    from parallel.expert import check_expert_parallel

    p = cfg.parallel
    if p.ep == 1:
        return
    try:
        check_expert_parallel(decoder_of(build_model(model_config(cfg))), resolved_dp(cfg, world_size), p.ep)
    except ValueError as error:
        raise ConfigError(str(error).strip().splitlines()[0]) from None


def validate_lora(cfg: DictConfig) -> list[str]:
    """lora.targets match at least one linear of the model's layers (the pass's own check, on the meta model);
    a warning for lora keys set while lora.rank=0 leaves them unread."""
    from training.methods.lora import lora_targets
    from training.config.schema import model_decoder
    from training.specs import lora_spec

    spec = lora_spec(cfg)
    if not spec.enabled:
        unread = [k.name for k in schema_keys() if k.name.startswith("lora.") and k.name != "lora.rank"
                  and OmegaConf.select(cfg, k.name) != k.default]
        return [f"{key}={shown(OmegaConf.select(cfg, key))} is read only when lora.rank>0 (here lora.rank=0); it is "
                "ignored" for key in unread]
    try:
        lora_targets(model_decoder(cfg), spec)
    except ValueError as error:
        raise ConfigError(str(error).strip().splitlines()[0]) from None
    return []


def validate_lora_init(cfg: DictConfig) -> None:
    """lora.init exists, is a regular file (or a PEFT folder of them) and its adapters fit the linears lora.targets
    adapts in this model (the pass's own reading, on the whole meta model)."""
    from checkpoint.errors import CheckpointError
    from parallel.materialize import dense_shape
    from training.config.schema import model_decoder
    from training.methods.lora import file_adapters, layer_linears, lora_targets
    from training.specs import lora_spec

    spec = lora_spec(cfg)
    if not spec.enabled or spec.init is None:
        return
    if not os.path.lexists(spec.init):
        raise ConfigError(f"lora.init={spec.init} does not exist; give a MiniMind LoRA .pth (scripts/export_hf.py "
                          "RUN OUT --adapters-only --format pth writes one) or a PEFT adapter folder")
    decoder = model_decoder(cfg)
    shapes = {name: dense_shape(module.weight, 1) for name, module in layer_linears(decoder)}
    try:
        file_adapters(spec, shapes, set(lora_targets(decoder, spec)), whole=True)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None


def validate_data(cfg: DictConfig, world_size: int | None = None) -> None:
    """Data source and files (the data module's own check), and the tokenizer's ids against the model's and against
    the tokenizer beside the initial weights."""
    from training.data import DataError, data_problem, load_tokenizer_vocab_size, run_data_spec, \
        weights_tokenizer_problem

    problem = data_problem(cfg, dp=resolved_dp(cfg, world_size))
    if problem:
        raise ConfigError(problem)
    try:
        vocab = load_tokenizer_vocab_size(cfg)  # synthetic: data.vocab_size, known without training it
        problem = weights_tokenizer_problem(cfg.checkpoint.load_dense, run_data_spec(cfg))
    except DataError as error:
        raise ConfigError(str(error)) from None
    if problem:
        raise ConfigError(problem)
    model_vocab = model_config(cfg).vocab_size
    if vocab > model_vocab:
        raise ConfigError(f"the tokenizer has {vocab} tokens but model.vocab_size={model_vocab}; "
                          f"set model.vocab_size>={vocab} or use a smaller tokenizer")


def validate_checkpoint(cfg: DictConfig) -> None:
    """A checkpoint to resume exists, is complete and readable, and was written for this model; a distillation
    teacher can teach it; LoRA's starting adapters (lora.init) fit; the folders the run writes (checkpoint.dir,
    data.cache_dir) can be created and written."""
    from checkpoint.manager import check_resume, find_checkpoint
    from training.config.output_paths import output_dir_problem

    dense = cfg.checkpoint.load_dense
    if dense and Path(dense).is_dir() and find_checkpoint(Path(dense)) is not None:
        raise ConfigError(f"checkpoint.load_dense={dense} is a training checkpoint, not dense weights; continue it "
                          f"with checkpoint.resume={dense}, or export it first (scripts/export_hf.py {dense} OUT) "
                          "and load OUT")
    if dense:
        from checkpoint.dense import CheckpointError, check_dense_files

        try:
            check_dense_files(dense)  # inside its folder, regular files: a FIFO would block every rank
        except CheckpointError as error:
            raise ConfigError(str(error)) from None
    for key in ("checkpoint.dir", "data.cache_dir"):
        if (value := OmegaConf.select(cfg, key)) and (problem := output_dir_problem(value, key)):
            raise ConfigError(problem)

    resume = cfg.checkpoint.resume
    if resume not in (None, "auto", "none") and not Path(resume).exists():
        raise ConfigError(f"checkpoint.resume={resume} does not exist; give a checkpoint, a checkpoints folder or a "
                          "run directory, or use checkpoint.resume=auto|none")
    from models import config_record

    from training.specs import lora_record

    problem = check_resume(resume, cfg.checkpoint.dir, config_record(model_config(cfg)), model_keys(), lora_record(cfg),
                           cfg.train.steps)
    if problem:
        raise ConfigError(problem)
    from training.methods.distill.teacher import teacher_problem  # reads the teacher's config, under train.task=distill only

    if problem := teacher_problem(cfg, model_config(cfg).vocab_size):
        raise ConfigError(problem)
    validate_lora_init(cfg)


def validate(cfg: DictConfig, world_size: int | None = None) -> list[str]:
    """Raise ConfigError with one readable line for the first bad value in cfg; return the warnings.

    The values it sets: schedule.n_microbatches where train.global_batch_size derives it, and
    parallel.layers_per_stage where it is auto."""
    check_known_keys(cfg)
    check_resolvable(cfg)
    warnings = check_keys(cfg)
    validate_model(cfg)
    warnings += validate_train(cfg)
    if problem := check_logger(cfg):  # wandb credentials and modes: the logger module's own rule
        raise ConfigError(problem)
    validate_parallel(cfg, world_size)
    resolve_global_batch(cfg, world_size)
    resolve_partition(cfg)
    validate_layout(cfg)
    validate_experts(cfg, world_size)
    warnings += validate_lora(cfg)
    validate_data(cfg, world_size)
    validate_checkpoint(cfg)
    return warnings
