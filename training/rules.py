"""The per-key rule catalogue: one range or choice rule for every schema key, and key scopes.

Types come from the schema (OmegaConf refuses `train.steps=many` while composing); this table adds what
a type cannot say. Cross-key rules live in `training.validate`.
"""

import math
import os
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from training.schema import schema_defaults

Check = Callable[[str, Any], "str | None"]  # (key, value) -> the one-line problem, or None when fine


class ConfigError(ValueError):
    """A bad run config; the message is one line naming the key and the fix."""


def shown(value: Any) -> str:
    """A value as the user typed it (lists without OmegaConf's wrapper)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value)
    return str(value)


def positive(key: str, value: Any) -> str | None:
    if not math.isfinite(value):
        return f"{key}={value} must be a finite number > 0"
    if value <= 0:
        return f"{key}={value} must be positive; set {key} to a value > 0"
    return None


def non_negative(key: str, value: Any) -> str | None:
    if not math.isfinite(value) or value < 0:
        return f"{key}={value} must be a finite number >= 0 (0 turns it off)"
    return None


def at_least(low: int) -> Check:
    def check(key: str, value: Any) -> str | None:
        return f"{key}={value} must be >= {low}" if value < low else None
    return check


def fraction(closed_top: bool = False) -> Check:
    """A number in [0, 1) (or [0, 1] with closed_top)."""
    top = "1]" if closed_top else "1)"

    def check(key: str, value: Any) -> str | None:
        inside = 0.0 <= value <= 1.0 if closed_top else 0.0 <= value < 1.0
        return None if inside else f"{key}={value} must lie in [0, {top}"
    return check


def one_of(*choices: Any) -> Check:
    def check(key: str, value: Any) -> str | None:
        if value in choices:
            return None
        return f"{key}={value} is not supported; use one of {', '.join(str(c) for c in choices)}"
    return check


def optional(inner: Check) -> Check:
    """null is allowed (it means "off" or "derive it"); any other value must pass `inner`."""
    return lambda key, value: None if value is None else inner(key, value)


def text(key: str, value: Any) -> str | None:
    return f"{key} is empty; give it a value" if not str(value).strip() else None


def any_of_type(key: str, value: Any) -> str | None:
    """The schema's type is the whole rule (booleans)."""
    return None


def checked_by(where: str) -> Check:
    """The range lives next to the code it protects (named here so the catalogue stays complete)."""
    return any_of_type


def existing_path(key: str, value: Any) -> str | None:
    if value is not None and not os.path.exists(value):
        return f"{key}={value} does not exist; give an existing path or drop the override"
    return None


def betas(key: str, value: Any) -> str | None:
    if len(value) != 2 or not all(0.0 <= b < 1.0 for b in value):
        return f"{key}={shown(value)} must be two numbers in [0, 1)"
    return None


def backends(key: str, value: Any) -> str | None:
    names = list(value)
    for name in names:
        if name not in LOGGER_BACKENDS:
            return f"{key}={shown(value)}: unknown logger {name!r}; use any of {', '.join(LOGGER_BACKENDS)}"
    if len(set(names)) != len(names) or ("none" in names and len(names) > 1):
        return f"{key}={shown(value)} repeats a logger or mixes none with loggers; list each logger once"
    return None


def fault(key: str, value: Any) -> str | None:
    from training.fault_spec import parse_fault

    try:
        parse_fault(value)
    except ValueError as error:
        return f"{key}={value}: {error}"
    return None


def layer_counts(key: str, value: Any) -> str | None:
    """null, auto or a list; the counts themselves are checked by parallel.pipeline.partition.layer_partition."""
    if value is None or value == "auto" or isinstance(value, (list, ListConfig)):
        return None
    return f"{key}={value}: give one layer count per stage (e.g. [3,3,2]), auto, or null for the even split"


def schedule_name(key: str, value: Any) -> str | None:
    from parallel.pipeline.schedules import SCHEDULES  # the registry is the closed set

    return one_of(*sorted(SCHEDULES), "table")(key, value)


LOGGER_BACKENDS = ("tensorboard", "wandb", "none")

# One rule per schema key (a test holds this table and the schema to the same keys).
KEY_RULES: dict[str, Check] = {
    "model.name": text,
    "model.hf_config": optional(text),  # the folder and its config.json: models.model_config
    "model.vocab_size": optional(positive),
    "model.hidden_size": optional(positive),
    "model.intermediate_size": optional(positive),
    "model.num_hidden_layers": optional(positive),
    "model.num_attention_heads": optional(positive),
    "model.num_key_value_heads": optional(positive),
    "model.max_position_embeddings": optional(positive),
    "model.rms_norm_eps": optional(positive),
    "model.rope_theta": optional(positive),
    "model.dropout": optional(fraction()),
    "model.use_moe": any_of_type,
    "model.num_experts": optional(positive),
    "model.num_experts_per_tok": optional(positive),
    "model.moe_intermediate_size": optional(positive),
    "model.norm_topk_prob": any_of_type,
    "model.router_aux_loss_coef": optional(non_negative),
    "model.initializer_range": optional(positive),
    "model.tie_word_embeddings": any_of_type,
    "parallel.dp": optional(positive),
    "parallel.tp": positive,
    "parallel.pp": positive,
    "parallel.vpp": positive,
    "parallel.layers_per_stage": layer_counts,
    "parallel.backend": one_of("auto", "gloo", "nccl"),
    "parallel.timeout_s": positive,
    "parallel.startup_timeout_s": positive,
    "parallel.emulate": any_of_type,
    "parallel.zero": one_of(0, 1),
    "parallel.bucket_mb": positive,
    "parallel.transport": one_of("auto", "shm", "p2p"),
    "parallel.plan": optional(one_of("auto")),
    "parallel.memory_budget_gb": optional(positive),
    "schedule.name": schedule_name,
    "schedule.n_microbatches": positive,
    "schedule.path": optional(text),  # the table loader reads and checks the file
    "train.steps": positive,
    "train.micro_batch_size": positive,
    "train.global_batch_size": optional(positive),
    "train.seq_len": at_least(2),  # one input and one label token at least
    "train.seed": at_least(0),
    "train.dtype": one_of("auto", "fp32", "bf16"),
    "train.grad_clip": non_negative,
    "train.log_every": positive,
    "train.trace_step": optional(positive),
    "train.recompute": one_of("none", "full", "selective"),
    "train.eval_every": non_negative,
    "train.eval_batches": positive,
    "train.on_nonfinite": one_of("stop", "skip"),
    "train.max_skipped_steps": positive,
    "train.max_restarts": non_negative,
    "train.peak_tflops": optional(positive),
    "optim.name": one_of("adamw"),
    "optim.lr": positive,
    "optim.min_lr_ratio": fraction(closed_top=True),
    "optim.weight_decay": non_negative,
    "optim.betas": betas,
    "optim.eps": positive,
    "optim.warmup_steps": non_negative,
    "data.name": one_of("synthetic", "jsonl"),
    "data.path": checked_by("training.data.check_data"),
    "data.tokenizer": checked_by("training.data.check_data"),
    "data.format": one_of("packed", "padded", "chat", "chat_packed"),
    "data.num_docs": positive,
    "data.seed": at_least(0),
    "data.vocab_size": at_least(259),  # 256 bytes + 3 special tokens
    "data.cache_dir": text,
    "data.val_path": optional(text),
    "data.val_fraction": fraction(),
    "data.skip_bad_lines": any_of_type,
    "data.max_line_bytes": positive,
    "checkpoint.dir": optional(text),
    "checkpoint.every": non_negative,
    "checkpoint.keep_last": positive,
    "checkpoint.resume": optional(text),
    "checkpoint.save_final": any_of_type,
    "checkpoint.load_dense": existing_path,
    "logger.name": one_of(*LOGGER_BACKENDS),
    "logger.backends": backends,
    "logger.project": text,
    "logger.mode": one_of("offline", "online", "disabled"),
    "debug.fault": optional(fault),
}

# Keys read only under another key's value: setting one elsewhere would be silently ignored. An error where
# the user surely meant something else (a data path under synthetic data), a warning where it is harmless.
# (A model key's scope depends on its family: `models.model_config` checks those.)
SCOPES: dict[str, tuple[str, tuple[Any, ...], bool]] = {  # key -> (switch, values that read it, is_error)
    "data.path": ("data.name", ("jsonl",), True),
    "data.tokenizer": ("data.name", ("jsonl",), True),
    "data.num_docs": ("data.name", ("synthetic",), False),
    "data.vocab_size": ("data.name", ("synthetic",), False),
    "schedule.path": ("schedule.name", ("table",), True),
    "train.max_skipped_steps": ("train.on_nonfinite", ("skip",), True),
    "parallel.memory_budget_gb": ("parallel.plan", ("auto",), False),  # scripts/plan.py --search reads it too
}


def check_keys(cfg: DictConfig) -> list[str]:
    """Raise ConfigError for the first key that breaks its rule or is out of scope; return warnings for harmless
    out-of-scope keys."""
    defaults = schema_defaults()
    for key, check in KEY_RULES.items():
        problem = check(key, OmegaConf.select(cfg, key))
        if problem:
            raise ConfigError(problem)
    warnings = []
    for key, (switch, allowed, is_error) in SCOPES.items():
        value, state = OmegaConf.select(cfg, key), OmegaConf.select(cfg, switch)
        if state not in allowed and value != defaults[key]:
            problem = (f"{key}={shown(value)} is read only when {switch}={'|'.join(map(str, allowed))} "
                       f"(here {switch}={state})")
            if is_error:
                raise ConfigError(f"{problem}; drop {key} or change {switch}")
            warnings.append(f"{problem}; it is ignored")
    return warnings
