"""The run header: a few aligned lines rank 0 prints once before step 1, saying what the run is about to do.

The figures are exact and counted from the things themselves: the parameters of the dense model (on the meta
device, LoRA's adapters added by their shapes), the rows and samples of the data splits, the pipeline partition the
engine uses (one cached `lower_pipeline`), and the label tokens of the steps this run reads."""

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from parallel.expert import expert_modules
from parallel.materialize import dense_shape
from parallel.pipeline.lowered import lower_pipeline
from parallel.pipeline.partition import rank_stages
from training.config.schema import model_decoder
from training.data import PackedSamples, PaddedSamples, StepBatches, run_data_spec
from training.data.pairs import PairSamples
from training.data.samples import Samples
from training.methods.lora import lora_targets
from training.specs import lora_spec, pipeline_spec

LABEL_WIDTH = 10
COUNTED_SAMPLES = 1 << 14  # label tokens are counted over the steps that read at most this many samples (one at least)


@dataclass(frozen=True)
class ModelSize:
    """Parameters of the whole model (each tied tensor once; LoRA's adapters included) and those that train."""

    description: str  # family, layers, hidden size
    num_layers: int
    parameters: int
    trainable: int
    adapted: int = 0  # linears given LoRA adapters
    lora_rank: int = 0
    moe: bool = False


def model_size(cfg: DictConfig) -> ModelSize:
    """The run's model counted on the meta device (no memory): every parameter of the dense model, plus the adapters
    LoRA gives its targets (rank x (in + out) each; the base is then frozen)."""
    decoder = model_decoder(cfg)
    config = decoder.config
    description = f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}"
    base = sum(p.numel() for p in decoder.module.parameters())  # a tied embedding is one Parameter: counted once
    moe = bool(expert_modules(decoder))
    spec = lora_spec(cfg)
    if not spec.enabled:
        return ModelSize(description, config.num_hidden_layers, base, base, moe=moe)
    targets = lora_targets(decoder, spec)
    adapters = sum(spec.rank * sum(dense_shape(decoder.module.get_submodule(name).weight, 1)) for name in targets)
    return ModelSize(description, config.num_hidden_layers, base + adapters, adapters, len(targets), spec.rank, moe)


def rows_of(samples: Samples) -> int:
    """The rows (documents, conversations; pairs under DPO) a sample set was made from."""
    if isinstance(samples, PairSamples):
        return rows_of(samples.rows) // 2
    if isinstance(samples, (PackedSamples, PaddedSamples)):
        return len(samples.starts)  # one start per selected document
    return len(samples)


@dataclass(frozen=True)
class LabelTokens:
    """Label tokens read by `steps` consecutive steps of this run, against the positions they compute."""

    steps: int
    labels: int
    positions: int


def label_tokens(data: StepBatches, steps: int) -> LabelTokens:
    """The label tokens of this run's next `steps` steps from the stream's position (the first steps reading at most
    COUNTED_SAMPLES samples, one step at least), counted as each step's loss counts them (a pair's: those of its
    chosen and rejected rows, two sequences of positions); the stream does not move."""
    per_step = data.global_batch_size
    counted = min(steps, max(1, COUNTED_SAMPLES // per_step))
    if isinstance(data.samples, PairSamples):  # the DPO loss is a mean over pairs: global_tokens_at counts pairs
        pairs = data._indices(data.position, counted * per_step)  # the stream's global order, as it reads the steps
        rows = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).flatten()
        labels = int(data.samples.rows.label_counts(rows).sum())
        return LabelTokens(counted, labels, counted * per_step * 2 * data.seq_len)
    labels = sum(data.global_tokens_at(data.position + k * per_step) for k in range(counted))
    return LabelTokens(counted, labels, counted * per_step * data.seq_len)


def _count(n: int) -> str:
    """An exact count, with a short form for large ones: 2,412,608 (2.41M)."""
    for size, unit in ((10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= max(size, 10**4):
            return f"{n:,} ({n / size:.3g}{unit})"
    return f"{n:,}"


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}{'es' if noun.endswith(('h', 's')) else 's'}"


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "-"


def _layers(span: range) -> str:
    return str(span.start) if len(span) == 1 else f"{span.start}-{span.stop - 1}"


def partition_line(cfg: DictConfig, num_layers: int) -> str:
    """The layers each pipeline rank holds, per virtual stage under interleaving or the V placement."""
    spec = pipeline_spec(cfg)
    if spec.n_stages == 1:
        return f"{num_layers} layers on one stage"
    pipeline = lower_pipeline(spec, num_layers)  # the engine's own (cached): its partition and placement
    counts = sorted({len(span) for span in pipeline.partition})
    each = f"{counts[0]} each" if len(counts) == 1 else f"{counts[0]} to {counts[-1]} each"
    chunks = "" if spec.vpp == 1 else f", {spec.vpp} per rank, {pipeline.placement} placement"
    ranks = " | ".join(f"rank {r} layers " + ", ".join(_layers(pipeline.partition[s])
                                                        for s in rank_stages(r, spec.pp, spec.vpp, pipeline.placement))
                       for r in range(spec.pp))
    return f"{num_layers} layers in {spec.n_stages} stages ({each}{chunks}): {ranks}"


def layout_line(cfg: DictConfig, dp: int, processes: int, moe: bool) -> str:
    """The grid, the schedule and the micro-batches of one step."""
    p, m, b = cfg.parallel, cfg.schedule.n_microbatches, cfg.train.micro_batch_size
    emulated = ", pp emulated" if p.pp > 1 and p.emulate else ""
    parts = [f"dp {dp} x tp {p.tp} x pp {p.pp} ({_plural(processes, 'process')}{emulated})"]
    if moe:
        parts.append(f"ep {p.ep}")
    if p.pp > 1:
        parts.append(f"schedule {cfg.schedule.get('module') or cfg.schedule.name}")
    return ", ".join(parts) + f"; {_plural(m, 'micro-batch')} x {b} sequences per replica; {dp * m * b} x " \
        f"{cfg.train.seq_len} tokens per step"


def model_line(size: ModelSize) -> str:
    """The model, its parameters and the share that trains."""
    trains = "all trainable" if size.trainable == size.parameters else (
        f"{size.trainable:,} trainable ({_share(size.trainable, size.parameters)}: LoRA rank {size.lora_rank} on "
        f"{size.adapted} linears, the rest frozen)")
    return f"{size.description}: {_count(size.parameters)} parameters, {trains}"


def data_line(data: StepBatches, fmt: str, pairs: bool) -> str:
    """The rows each split was made from and the samples (pairs) cut from them."""
    def split(name: str, samples: Samples) -> str:
        if pairs:
            return f"{name} {rows_of(samples):,} pairs ({2 * len(samples):,} conversations of {samples.seq_len} tokens)"
        return f"{name} {rows_of(samples):,} rows -> {len(samples):,} samples of {samples.seq_len} tokens"

    val = split("val", data.held_out) if data.held_out is not None else "no val split"
    skipped = f"; {data.skipped_lines:,} bad lines skipped" if data.skipped_lines else ""
    return f"{split('train', data.samples)}, {val} ({fmt}){skipped}"


def steps_line(data: StepBatches, steps: int, unit: str, epochs: float | None = None) -> str:
    """The samples the configured steps read, and the epochs of the training split they cover (the steps that
    `train.epochs` derived, when set)."""
    per_step, read = data.global_batch_size, steps * data.global_batch_size
    derived = f"train.epochs={epochs:g} -> " if epochs is not None else ""
    return (f"{derived}{steps:,} x {per_step:,} {unit} = {read:,} {unit} = {read / data.num_samples:.3g} epochs of the "
            f"{data.num_samples:,} training {unit}")


def tokens_line(data: StepBatches, remaining: int) -> str:
    """Label tokens against positions over this run's steps (or the first of them); pairs: chosen and rejected."""
    tokens = label_tokens(data, remaining)
    counted = _plural(tokens.steps, "step")
    over = f"this run's {counted}" if tokens.steps == remaining else f"the first {counted}"
    pairs = f" ({data.global_batch_size:,} pairs, chosen and rejected)" if isinstance(data.samples, PairSamples) else ""
    return (f"{tokens.positions // tokens.steps:,} per step{pairs}, label tokens "
            f"{_share(tokens.labels, tokens.positions)} ({tokens.labels:,} of {tokens.positions:,} over {over})")


def resumed_line(first_step: int, steps: int, resumed_from: Path | None, position: int, unit: str) -> str:
    """Where a resumed run resumed (step, checkpoint, position in the data) and the steps it does now."""
    remaining = steps - first_step
    if remaining > 1:
        todo = f"this run does steps {first_step + 1:,}-{steps:,} ({remaining:,} steps)"
    else:
        todo = f"this run does step {steps:,}" if remaining == 1 else f"nothing left to do (train.steps={steps})"
    return f"from step {first_step:,} ({resumed_from}), at {unit[:-1]} {position:,}: {todo}"


def run_header(cfg: DictConfig, data: StepBatches, dp: int, processes: int, first_step: int = 0,
               resumed_from: Path | None = None) -> list[str]:
    """The header's lines: model, data, steps and epochs, layout, partition, tokens per step, and where a resumed run
    resumed from. `data` is the training stream (at its resume position), `first_step` the step it resumed at."""
    spec, steps = run_data_spec(cfg), cfg.train.steps
    grpo = spec.train_task == "grpo"
    unit = "pairs" if spec.preference else "prompts" if grpo else "samples"
    size = model_size(cfg)
    lines = [("model", model_line(size)), ("data", data_line(data, spec.format, spec.preference)),
             ("steps", steps_line(data, steps, unit, cfg.train.get("epochs"))),
             ("layout", layout_line(cfg, dp, processes, size.moe)),
             ("partition", partition_line(cfg, size.num_layers))]
    if grpo:  # the label tokens are generated each step: say what a step generates instead
        g = cfg.grpo
        lines.append(("grpo", f"{data.global_batch_size} prompts x {g.num_generations} completions per step, up to "
                              f"{g.max_new_tokens} new tokens each after a prompt of up to {data.seq_len}; "
                              f"{g.loss_type} loss, beta {g.beta}"))
    elif steps > first_step:
        lines.append(("tokens", tokens_line(data, steps - first_step)))
    if first_step:
        lines.append(("resumed", resumed_line(first_step, steps, resumed_from, data.position, unit)))
    return [f"{label:<{LABEL_WIDTH}} {text}" for label, text in lines]
