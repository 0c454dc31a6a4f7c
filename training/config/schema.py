"""The run-config schema, the one home of every key: its type, default, value rule and one-line meaning side by side.

Validation (`training.config.validate`), `python train.py --help` and the key tables of docs/configuration.md are all
read from these fields (`scripts/config_docs.py` writes the tables). Adding a key is its line here and the code that
uses it. A `name` is MISSING: the preset that conf/config.yaml's defaults list picks sets it.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from omegaconf import MISSING

from training.methods.distill.schema import DistillSchema
from training.methods.grpo.schema import GrpoSchema
from training.data.schema import DataSchema
from training.rules.keys import ReadWhen, key
from training.config.presets import CONF_DIR, store_presets
from training.rules.values import (LOGGER_BACKENDS, Rule, at_least, backends, betas, existing_path,
                                    fault, fraction, layer_counts, non_negative, one_of, optional, positive,
                                    schedule_name, seed_value, text)

@dataclass
class ModelSchema:
    """The model: a preset `name`, `hf_config` (a transformers config.json folder; none: MiniMind) and fields set on
    top of the family's defaults (null keeps the default: MiniMindConfig's, or the config.json's)."""

    name: str = key(MISSING, "the preset's name (recorded; not a model field; the preset sets it)", text)
    hf_config: Optional[str] = key(
        None, "a folder holding a transformers `config.json` (e.g. one written by `save_pretrained`); relative paths "
        "also resolve against the repository (`models/configs/llama-tiny`)", optional(text))
    vocab_size: Optional[int] = key(None, "embedding and LM-head rows; must be at least the tokenizer's vocabulary",
                                    optional(positive))
    hidden_size: Optional[int] = key(None, "width of the residual stream", optional(positive))
    intermediate_size: Optional[int] = key(
        None, "SwiGLU width; MiniMind's `null` = `ceil(hidden_size * pi / 64) * 64` (2432 at 768)", optional(positive))
    num_hidden_layers: Optional[int] = key(None, "decoder layers (split over pipeline stages)", optional(positive))
    num_attention_heads: Optional[int] = key(
        None, "query heads; must divide `hidden_size` (where `head_dim` is derived) and be divisible by `parallel.tp`",
        optional(positive))
    num_key_value_heads: Optional[int] = key(
        None, "key/value heads (grouped-query attention); must divide the query heads", optional(positive))
    max_position_embeddings: Optional[int] = key(None, "RoPE table length; `train.seq_len` may not exceed it",
                                                 optional(positive))
    rms_norm_eps: Optional[float] = key(None, "epsilon of every RMSNorm", optional(positive))
    rope_theta: Optional[float] = key(
        None, "RoPE base frequency (transformers' families: written into `rope_parameters`)", optional(positive))
    dropout: Optional[float] = key(None, "attention and residual dropout probability (MiniMind only)",
                                   optional(fraction()))
    use_moe: Optional[bool] = key(
        None, "replace each MLP with routed experts (MiniMind only; Qwen3-MoE is MoE by its config)")
    num_experts: Optional[int] = key(None, "experts per MoE layer", optional(positive))
    num_experts_per_tok: Optional[int] = key(None, "experts each token is routed to (top-k)", optional(positive))
    moe_intermediate_size: Optional[int] = key(None, "expert width; MiniMind's `null` = `intermediate_size`",
                                               optional(positive))
    norm_topk_prob: Optional[bool] = key(None, "renormalise the top-k routing weights to sum to 1")
    router_aux_loss_coef: Optional[float] = key(
        None, "weight of the load-balancing auxiliary loss (`aux_loss` in the metrics)", optional(non_negative))
    initializer_range: Optional[float] = key(None, "standard deviation of the initial weights", optional(positive))
    tie_word_embeddings: Optional[bool] = key(
        None, "share the embedding and LM-head weights (kept equal across stages)")


@dataclass
class ParallelSchema:
    """Layout: data, tensor and pipeline parallel sizes, virtual stages and runtime settings."""

    dp: Optional[int] = key(
        None, "data-parallel replicas; `null` = world size / (tp * pp), or 1 when Sluice launches the workers itself",
        optional(positive))
    tp: int = key(1, "tensor-parallel ranks (heads and MLP columns split; keep inside a node)", positive)
    pp: int = key(1, "pipeline-parallel ranks", positive)
    ep: int = key(
        1, "expert-parallel ranks, carved out of DP: each run of `ep` DP ranks splits every MoE layer's experts "
        "between them and sends each token to its expert's rank (all_to_all); attention, router and dense parts stay "
        "data-parallel. Must divide `model.num_experts` and the DP size; `1` on a dense model", positive)
    vpp: int = key(1, "virtual stages (model chunks) per pipeline rank; the schedule says which it accepts", positive)
    layers_per_stage: Any = key(
        None, "explicit layer counts per stage, e.g. `[3,3,2]`; `null` = balanced to one layer; `auto` = balanced by "
        "cost (embedding on the first stage, head and loss on the last), from the costs `scripts/profile_costs.py` "
        "cached for the shape, else from FLOPs; the launch log says what it chose", layer_counts)
    backend: str = key("auto", "`auto` (NCCL with CUDA, else gloo), `gloo`, `nccl`", one_of("auto", "gloo", "nccl"))
    timeout_s: float = key(300.0, "seconds any blocking wait after start-up (send, receive, collective) may take",
                           positive)
    startup_timeout_s: float = key(
        600.0, "bound of every start-up wait (joining the process group while peers still import, agreeing on the "
        "run directory); `parallel.timeout_s` bounds every wait after it", positive)
    emulate: bool = key(False, "run all `pp` pipeline ranks inside each process (see "
                               "[emulation](concepts.md#emulation))")
    zero: int = key(0, "`1`: shard the optimizer state over the DP group (ZeRO-1, torch's "
                       "`ZeroRedundancyOptimizer`); with `parallel.ep > 1` the experts' state over the DP ranks "
                       "holding the same experts; `2` and `3`: parameters, gradients and optimizer state (torch's "
                       "FSDP2 `fully_shard` per decoder layer), 1/dp of each held between steps; in a step `2` "
                       "gathers a layer once and reduces once, `3` gathers per pass and reduces per micro-batch (what "
                       "each saves and when to choose it: [concepts](concepts.md#sharded-data-parallelism))",
                    one_of(0, 1, 2, 3))
    dp_replicate: int = key(1, "with `parallel.zero=2/3`: DP replicas of the shards (HSDP: shard within a group of "
                               "dp / dp_replicate ranks, replicate across groups); must divide the DP size", positive,
                            ReadWhen("parallel.zero", (2, 3), True))
    mixed_precision_param: str = key(
        "fp32", "with `parallel.zero=2/3`: the dtype FSDP gathers the weights in and the layers compute in "
        "(torchtitan's name): `fp32` the master weights as they are, computing in `train.dtype` (one process's "
        "numbers); `bf16` gathers and computes in bf16 whatever `train.dtype` says and reduces the gradients in fp32 "
        "into the fp32 master shards (FSDP2's `MixedPrecisionPolicy`; [concepts](concepts.md#precision-and-offload))",
        one_of("fp32", "bf16"), ReadWhen("parallel.zero", (2, 3), True))
    cpu_offload: bool = key(
        False, "with `parallel.zero=2/3`, on CUDA: the weight shards, their gradients and AdamW's state in pinned CPU "
        "memory, each layer's weights copied to the GPU when gathered and AdamW stepping on the CPU (FSDP2's "
        "`CPUOffloadPolicy`, torchtitan's `enable_cpu_offload`; [concepts](concepts.md#precision-and-offload))",
        read_when=ReadWhen("parallel.zero", (2, 3), True))
    bucket_mb: float = key(
        25.0, "size (MB) of the gradient buckets whose DP reduction starts as soon as their gradients are final, "
        "overlapping the backward", positive)
    transport: str = key(
        "auto", "how pipeline ranks pass boundary tensors: `shm` (shared memory between the ranks of one host, CPU "
        "tensors; see [concepts](concepts.md#transport)), `p2p` (torch.distributed send/recv: gloo or NCCL); `auto` = "
        "`shm` when every rank is on one host and computes on the CPU, else `p2p`", one_of("auto", "shm", "p2p"))
    layout: Optional[str] = key(
        None, "`auto`: before launch, search every layout (dp, tp, pp, vpp, ep of a MoE model, schedule, micro-batches "
        "at the same global batch, recompute, partition, and `parallel.zero` where dp >= 2 unless the config sets a "
        "level) of the launched world on measured costs and run the fastest predicted one within `memory_budget_gb`; prints `sluice: parallel.layout=auto chose ...`. `python scripts/preview.py "
        "--search world_size=N ...` shows the whole ranking", optional(one_of("auto")))
    memory_budget_gb: Optional[float] = key(
        None, "per-rank memory budget (GiB): `layout=auto` and `scripts/preview.py --search` reject a layout whose "
        "predicted peak exceeds it; a fixed layout is refused before launch when its predicted peak per rank does "
        "(`null`: the check compares with each GPU's memory, or the host's available memory for all its ranks)",
        optional(positive))


@dataclass
class ScheduleSchema:
    """Pipeline schedule by name (or a table file, or a generator in a module) and micro-batches per step."""

    name: str = key(MISSING, "the pipeline schedule (the preset sets it)", schedule_name)
    n_microbatches: int = key(4, "micro-batches per step and per DP replica", positive)
    path: Optional[str] = key(None, "CSV or JSON schedule table, with `schedule=table`", optional(text),
                              ReadWhen("schedule.name", ("table",), refuse=True))  # the table loader checks the file
    module: Optional[str] = key(None, "`pkg.module:function`: a schedule generator of your own, with `schedule=module`",
                                optional(text), ReadWhen("schedule.name", ("module",), refuse=True))


@dataclass
class TrainSchema:
    """Loop settings: steps, batch geometry, seed, precision, clipping, logging cadence."""

    task: str = key(
        "pretrain", "what the run trains: `pretrain` and `sft` the next-token loss on `data.format`'s samples (`sft`: "
        "conversations, a chat format), `dpo` the DPO loss on MiniMind `dpo.jsonl` pairs (`chosen` / `rejected` "
        "conversations, `data.format=chat`; the reference is the starting weights; "
        "[concepts](concepts.md#dpo)), `distill` the next-token loss mixed with a teacher's (`distill.*`), `grpo` "
        "MiniMind's GRPO / CISPO on completions the model samples for prompts (`grpo.*`; [concepts](concepts.md#grpo))",
        one_of("pretrain", "sft", "dpo", "distill", "grpo"))
    steps: int = key(1000, "optimizer steps (`train.epochs`, when set, derives them instead)", positive)
    epochs: Optional[float] = key(
        None, "passes over the training samples (MiniMind's `--epochs`): when set, `train.steps` = ceil(epochs x "
        "training samples / samples per step), counted from the data and shown in the run header; giving both on "
        "the command line is refused", optional(positive))
    micro_batch_size: int = key(8, "sequences per micro-batch (under `train.task=dpo` an even number: whole pairs; "
                                   "under `grpo` a multiple of `grpo.num_generations`: whole groups)",
                                positive)
    global_batch_size: Optional[int] = key(
        None, "sequences per optimizer step across DP; when set, `schedule.n_microbatches` = `global_batch_size / "
        "(dp * micro_batch_size)` (it must divide)", optional(positive))
    seq_len: int = key(256, "tokens per sequence", at_least(2))  # one input and one label token at least
    seed: int = key(42, "seed of the initial weights (the same for every layout) and of the sample order "
                        "(reshuffled each epoch unless `data.shuffle=false`)", seed_value)
    dtype: str = key("auto", "compute dtype: `auto` (bf16 on CUDA, fp32 on CPU), `fp32`, `bf16`",
                     one_of("auto", "fp32", "bf16"))
    grad_clip: float = key(1.0, "global gradient-norm clipping threshold; `0` = off", non_negative)
    log_every: int = key(10, "log a metrics record every N steps (the first and last step are always logged)", positive)
    trace_step: Optional[int] = key(
        None, "step (1-based) to trace: Chrome trace and measured-vs-simulated PNG in the run directory",
        optional(positive))
    recompute: str = key(
        "none", "activation recomputation: `none`, `full` (each decoder layer), `selective` (attention core and MLP "
        "activations)", one_of("none", "full", "selective"))
    compile: Optional[Union[bool, str]] = key(
        None, "`true`: compile each decoder layer with `torch.compile` (inductor) after the TP, EP and recompute "
        "passes; the first step also compiles (its time is logged); numbers equal eager within fp32 round-off. "
        "`auto`: compile, run step 2 eager, time steps 3-10 compiled and eager in turns, keep the faster median "
        "(logged); `null` = `auto` on CUDA, `false` on CPU", optional(one_of(True, False, "auto")))
    eval_every: int = key(0, "validation every N steps and at the end (`0` = never): `val_loss` and `val_ppl` in the "
                             "metrics", non_negative)
    eval_batches: int = key(10, "batches per validation pass", positive)
    on_nonfinite: str = key("stop", "a non-finite loss or gradient norm: `stop` every rank, or `skip` the update",
                            one_of("stop", "skip"))
    max_skipped_steps: int = key(3, "with `skip`: stop after this many skipped steps in a row", positive,
                                 ReadWhen("train.on_nonfinite", ("skip",), refuse=True))
    allow_batch_change: bool = key(
        False, "resume a checkpoint written at another global batch (dp x n_microbatches x micro_batch_size); refused "
        "otherwise, since its steps, learning-rate schedule and data position count in its batch")
    max_restarts: int = key(
        0, "self-launch: restart the workers after a crash or kill, from the newest checkpoint, up to N times per "
        "checkpoint ([launching](launching.md#surviving-a-lost-worker-trainmax_restarts))", non_negative)
    peak_tflops: Optional[float] = key(
        None, "per-device peak TFLOP/s for `mfu`; `null` = the GPU's known bf16 peak, none on CPU", optional(positive))


@dataclass
class OptimSchema:
    """AdamW with linear warm-up then cosine decay to min_lr_ratio * lr."""

    name: str = key(MISSING, "the optimizer (AdamW is the only one; the preset sets it)", one_of("adamw"))
    lr: float = key(5e-4, "peak learning rate", positive)
    min_lr_ratio: float = key(0.1, "floor of the cosine decay, as a fraction of `lr`", fraction(closed_top=True))
    weight_decay: float = key(0.01, "decoupled weight decay", non_negative)
    betas: list[float] = key([0.9, 0.95], "Adam's beta1, beta2", betas)
    eps: float = key(1e-8, "Adam's epsilon", positive)
    warmup_steps: int = key(100, "steps of linear warm-up from 0 to `lr`", non_negative)


@dataclass
class CheckpointSchema:
    """Training checkpoints and dense-weight loading."""

    dir: Optional[str] = key(None, "where training checkpoints go (`null` = `<run dir>/checkpoints`)", optional(text))
    every: int = key(0, "save a training checkpoint every N steps (`0` = never)", non_negative)
    keep_last: int = key(3, "training checkpoints kept", positive)
    resume: Optional[str] = key(None, "a training checkpoint to resume from (a checkpoint, a checkpoints folder, a "
                                      "run directory, `auto` or `none`)", optional(text))
    save_final: bool = key(True, "save a training checkpoint at the end")
    export_pth: bool = key(False, "each save also writes MiniMind's fp16 `<run>/out/<stage>_<hidden>.pth`")
    load_dense: Optional[str] = key(
        None, "initial weights: an HF folder, a `.safetensors` file or a MiniMind `.pth`", existing_path)


@dataclass
class LoraSchema:
    """LoRA fine-tuning: low-rank adapters on the decoder layers' linears, every other weight frozen (rank 0: off)."""

    rank: int = key(
        0, "adapter rank `r`; `0` = no adapters, every weight trains. With `r > 0` only the adapters train: the base "
        "weights get no gradient, no DP bucket and no optimizer state, and checkpoints hold both "
        "([checkpoints](checkpoints.md#lora))", at_least(0))
    alpha: Optional[float] = key(
        None, "the adapters' output is scaled by `alpha / rank`; `null` = `rank` (scale 1, as MiniMind's "
        "train_lora)", optional(positive))
    targets: Optional[list[str]] = key(
        None, "the linears of the decoder layers that get adapters, as name patterns matched against a name's end "
        "(`q_proj`, `self_attn.*`, `mlp.experts.*.up_proj`; `*` stands for one name component); `null` = every "
        "square linear (in = out: `q_proj` and `o_proj` when heads x head_dim = hidden), MiniMind's choice")
    dropout: float = key(0.0, "dropout on the adapters' input (the base linear sees the whole input)", fraction())
    init: Optional[str] = key(
        None, "adapters the run starts from instead of lora_A normal / lora_B zeros: a MiniMind LoRA `.pth` (its "
        "`save_lora`, or `scripts/export_hf.py RUN OUT --adapters-only --format pth`) or a PEFT adapter folder "
        "(`--adapters-only`); its linears must be the ones `lora.targets` adapts, its rank `lora.rank` "
        "([checkpoints](checkpoints.md#lora))", optional(text))


@dataclass
class DpoSchema:
    """Direct preference optimisation (`train.task=dpo`)."""

    beta: float = key(0.1, "the DPO temperature: the loss is `-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))` "
                           "and the logged rewards `beta * (pi - ref)` (MiniMind's train_dpo.py passes 0.15)", positive,
                      ReadWhen("train.task", ("dpo",), refuse=False))


@dataclass
class LoggerSchema:
    """Rank-0 metric sinks besides metrics.jsonl; `name` is the preset, `backends` the sinks it writes."""

    name: str = key(MISSING, "the preset's name", one_of(*LOGGER_BACKENDS))
    backends: list[str] = key(MISSING, "the sinks to write: any of `tensorboard`, `wandb` (`[]` or `[none]` for "
                                       "none; the preset sets it)", backends)
    project: str = key("sluice", "the wandb project", text)
    mode: str = key("offline", "wandb mode: `offline` (no key needed; `wandb sync` later), `online` (needs `wandb "
                               "login` or `WANDB_API_KEY`), `disabled`", one_of("offline", "online", "disabled"))


@dataclass
class DebugSchema:
    """Rehearsal switches."""

    fault: Optional[str] = key(
        None, "fault injection for rehearsals and tests: `stall`, `crash`, `nan`, `stop` (SIGSTOP: a frozen host), "
        "`kill` (SIGKILL, first start only), `sigint` or `sigterm` (an interrupt) `@rank=R,step=S[,action=A]`, e.g. "
        "`stall@rank=1,step=3`", optional(fault))


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
    lora: LoraSchema = field(default_factory=LoraSchema)
    dpo: DpoSchema = field(default_factory=DpoSchema)
    distill: DistillSchema = field(default_factory=DistillSchema)
    grpo: GrpoSchema = field(default_factory=GrpoSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)
    debug: DebugSchema = field(default_factory=DebugSchema)


@dataclass(frozen=True)
class SchemaKey:
    """One leaf of the schema as the validators and the docs read it."""

    name: str  # "train.steps"
    type: Any
    default: Any
    meaning: str
    rule: Rule
    read_when: ReadWhen | None


def schema_keys(node: type = RunSchema, prefix: str = "") -> list[SchemaKey]:
    """Every leaf key of the schema, in declaration order."""
    keys: list[SchemaKey] = []
    for f in dataclasses.fields(node):
        if dataclasses.is_dataclass(f.type):  # a section
            keys += schema_keys(f.type, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        keys.append(SchemaKey(f"{prefix}{f.name}", f.type, default, f.metadata["meaning"], f.metadata["rule"],
                              f.metadata["read_when"]))
    return keys


def register_schema() -> None:
    """Make `base_config` and the registered schedules' presets available to the defaults list of conf/config.yaml."""
    store_presets(RunSchema)


def compose_config(overrides: list[str], with_hydra: bool = False) -> Any:
    """The run config `python train.py <overrides>` composes, not validated (Hydra's errors propagate);
    `with_hydra` keeps Hydra's own section (run and sweep directories)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)
    finally:
        GlobalHydra.instance().clear()


def model_config(cfg: Any):
    """The transformers config of the run's model section (MiniMind's, or the family of `model.hf_config`)."""
    from omegaconf import OmegaConf

    from models import model_config as resolve  # every model family (seconds to import): only once a model is built

    return resolve(OmegaConf.to_container(cfg.model, resolve=True))


def model_decoder(cfg: Any):
    """The run's dense model on the meta device (shapes only, no memory), as a `parallel.decoder.Decoder`."""
    from models import build_model, decoder_of  # every model family (seconds to import): only once a model is built

    return decoder_of(build_model(model_config(cfg)))


def model_keys() -> tuple[str, ...]:
    """The model fields a run may set (the schema's model section, the preset name aside)."""
    return tuple(f.name for f in dataclasses.fields(ModelSchema) if f.name != "name")


def schema_defaults() -> dict[str, Any]:
    """Every leaf key of the schema ("train.steps") with its default value (`???` where a preset sets it)."""
    return {k.name: k.default for k in schema_keys()}


def schema_sections() -> tuple[str, ...]:
    """The top-level sections of the run config ("model", "parallel", ...)."""
    return tuple(f.name for f in dataclasses.fields(RunSchema))
