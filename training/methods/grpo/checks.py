"""The pre-launch check of a GRPO run (`train.task=grpo`): one line for what would fail at step 1 or later, read
from the config and the data's first rows, writing nothing."""

from typing import Any

from training.data.spec import DataError, DataSpec, Geometry, geometry, optional_field, run_data_spec
from training.methods.grpo.reward_model import reward_model_problem
from training.methods.grpo.rewards import RewardError, reward_function
from training.data.tokenizer import EMBEDDED_TOKENIZER, load_tokenizer, synthetic_tokenizer_dir
from training.data.sources import data_source

HEAD_ROWS = 100  # prompt rows read before launch; the loader checks every row


def layout_problem(cfg: Any, geo: Geometry) -> str | None:
    """Groups that do not fit a micro-batch, a completion that leaves no room for a prompt, keys GRPO has no use for."""
    grpo, train = cfg.grpo, cfg.train
    group, new = int(grpo.num_generations), int(grpo.max_new_tokens)
    if geo.micro_batch_size % group:
        return (f"train.micro_batch_size={geo.micro_batch_size} is not a multiple of grpo.num_generations={group}: a "
                "micro-batch holds whole groups of completions; use a multiple")
    if new >= geo.seq_len:
        return (f"grpo.max_new_tokens={new} leaves no room for the prompt in train.seq_len={geo.seq_len} (a row is the "
                "prompt, then the completion); raise train.seq_len or lower grpo.max_new_tokens")
    if int(optional_field(train, "eval_every") or 0):
        return "train.task=grpo has no held-out loss to evaluate; set train.eval_every=0"
    return None


def reward_problem(cfg: Any, spec: DataSpec) -> str | None:
    """A reward `_target_` that does not import, or a reward model folder that cannot score this run's text."""
    for entry in cfg.grpo.rewards:
        try:
            reward_function(entry)
        except RewardError as error:
            return str(error)
    return reward_model_problem(cfg.grpo.reward_model, known_tokenizer(spec))


def known_tokenizer(spec: DataSpec):
    """The run's tokenizer where it exists without training (a folder, or the embedded one already cached)."""
    from pathlib import Path

    if spec.name == "synthetic" or spec.tokenizer == EMBEDDED_TOKENIZER:
        folder = synthetic_tokenizer_dir(spec)
        return load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    return load_tokenizer(spec.tokenizer) if spec.tokenizer and Path(spec.tokenizer).is_dir() else None


def prompts_problem(spec: DataSpec, geo: Geometry, dp: int) -> str | None:
    """The first bad prompt row of `data.path`, or fewer prompts than one global batch of them."""
    batch = geo.global_batch(dp)
    if spec.name == "synthetic":
        available = spec.num_docs
    else:
        source = data_source(spec, "data.path")
        if source.kind == "hub":
            return None
        rows = source.reader(limit=HEAD_ROWS)
        try:
            usable = sum(1 for _ in rows)
        except DataError as error:
            return str(error)
        if usable == 0 and not rows.cut:
            return (f"data.path: no usable prompt in '{source.path}' (every row is bad); give MiniMind rlaif.jsonl "
                    "rows: conversations with a user turn")
        available = usable if not rows.cut else batch  # more rows than read: the loader counts them
    if available < batch:
        return (f"data: {available} prompts, fewer than one global batch of {batch} = dp {dp} x "
                f"schedule.n_microbatches {geo.n_microbatches} x train.micro_batch_size {geo.micro_batch_size} / "
                f"grpo.num_generations {geo.rows_per_sample}; use more prompts or a smaller batch")
    return None


def grpo_problem(cfg: Any, dp: int) -> str | None:
    """One line for the first problem of a GRPO run (its data passed the data's own check), or None."""
    spec, geo = run_data_spec(cfg), geometry(cfg)
    if problem := layout_problem(cfg, geo):
        return problem
    if spec.val_path is not None or spec.val_fraction > 0:
        return "train.task=grpo holds no prompts out; drop data.val_path and data.val_fraction"
    return reward_problem(cfg, spec) or prompts_problem(spec, geo, dp)
