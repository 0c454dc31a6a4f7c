"""The run config's keys and values checked by pydantic: one model per schema section, built from the dataclasses
Hydra composes (`training.config.schema`, so there is one schema), with `extra='forbid'` refusing every key outside it
(`+` or not, the nearest valid key suggested) and each key's value rule (`training.rules.values`) as its field
validator, whose line is the message. Rules that relate several keys live in `training.config.validate`."""

import dataclasses
from difflib import SequenceMatcher
from collections.abc import Iterator
from functools import cache
from typing import Annotated, Any

from omegaconf import MISSING, DictConfig, OmegaConf
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic_core import PydanticCustomError

from training.config.schema import RunSchema, schema_defaults, schema_keys, schema_sections
from training.rules.values import Rule, shown


# Names other trainers (Megatron-LM, HF Trainer, torchtitan) use for a schema key: spelling is no guide there.
KNOWN_ALIASES = {
    "activation_checkpointing": "train.recompute", "gradient_checkpointing": "train.recompute",
    "learning_rate": "optim.lr", "max_steps": "train.steps", "train_iters": "train.steps",
    "batch_size": "train.micro_batch_size", "seq_length": "train.seq_len", "max_seq_len": "train.seq_len",
    "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
    # MiniMind's trainer arguments (trainer/train_*.py)
    "data_path": "data.path", "epochs": "train.epochs", "accumulation_steps": "schedule.n_microbatches",
    "grad_clip": "train.grad_clip", "log_interval": "train.log_every", "save_interval": "checkpoint.every",
    "save_dir": "checkpoint.dir", "from_weight": "checkpoint.load_dense", "from_resume": "checkpoint.resume",
    "use_wandb": "logger", "hidden_size": "model.hidden_size", "num_hidden_layers": "model.num_hidden_layers",
    "use_moe": "model.use_moe",
}
# Keys renamed so that a word keeps one meaning (docs/concepts.md#names): old key -> new key.
RENAMED_KEYS = {"parallel.plan": "parallel.layout"}


def nearest_key(key: str) -> str:
    """The schema key closest to `key`: a known alias, else within its section, else by full or leaf name."""
    keys, sections = list(schema_defaults()), schema_sections()
    if key.rpartition(".")[2] in KNOWN_ALIASES:
        return KNOWN_ALIASES[key.rpartition(".")[2]]
    section, _, leaf = key.rpartition(".")
    if section in sections:
        pool = [k for k in keys if k.startswith(f"{section}.")]
        return max(pool, key=lambda k: SequenceMatcher(None, leaf, k.rpartition(".")[2]).ratio())

    def score(candidate: str) -> float:
        return max(SequenceMatcher(None, key, candidate).ratio(),
                   SequenceMatcher(None, key.rpartition(".")[2], candidate.rpartition(".")[2]).ratio())
    return max([*keys, *sections], key=score)


def unknown_key(key: str) -> str:
    """The one-line refusal of a key outside the schema (never suggesting `+`: no key may be added)."""
    if key in RENAMED_KEYS:
        return f"{key}: renamed to {RENAMED_KEYS[key]} (e.g. {RENAMED_KEYS[key]}=auto)"
    return f"{key}: unknown config key; did you mean {nearest_key(key)}? (`python train.py --cfg job` prints every key)"


def override_key_problem(keys: list[str], groups: set[str]) -> str | None:
    """The first override key (already stripped of `+`/`~`) that is neither a schema key nor a config group."""
    known, sections = set(schema_defaults()), set(schema_sections())
    for key in keys:
        if key in known or key in sections or key in groups or key.split(".")[0].split("/")[0] == "hydra":
            continue
        return unknown_key(key)
    return None


def _validator(name: str, rule: Rule) -> AfterValidator:
    """A schema key's rule as a pydantic field validator raising the rule's line (a MISSING value reads as None)."""
    def check(value: Any) -> Any:
        if problem := rule(name, None if value == MISSING else value):
            raise PydanticCustomError("sluice_rule", "{line}", {"line": problem})
        return value
    return AfterValidator(check)


@cache
def section_model(node: type = RunSchema, prefix: str = "") -> type[BaseModel]:
    """The pydantic model of a schema dataclass: its sections nested, its keys typed by the schema and checked by
    their rules (OmegaConf already enforced the types while composing)."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(node):
        if dataclasses.is_dataclass(f.type):
            fields[f.name] = (section_model(f.type, f"{prefix}{f.name}."), Field(default_factory=dict))
        else:
            fields[f.name] = (Annotated[Any, _validator(f"{prefix}{f.name}", f.metadata["rule"])], None)
    return create_model(node.__name__, __config__=ConfigDict(extra="forbid"), **fields)


def run_config_problem(cfg: DictConfig) -> str | None:
    """The first key of a resolved run config outside the schema (those first), else the first value breaking its
    key's rule, in declaration order; None when every key and value passes."""
    values = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
    try:
        section_model().model_validate(values)
    except ValidationError as error:
        first = min(error.errors(), key=lambda e: e["type"] != "extra_forbidden")
        return unknown_key(".".join(map(str, first["loc"]))) if first["type"] == "extra_forbidden" else first["msg"]
    return None


def out_of_scope(cfg: DictConfig) -> Iterator[tuple[bool, str]]:
    """(refused, line) for each key set away from its default while the key it depends on leaves it unread."""
    for key in (k for k in schema_keys() if k.read_when):
        scope, value = key.read_when, OmegaConf.select(cfg, key.name)
        state = OmegaConf.select(cfg, scope.switch)
        if state not in scope.values and value != key.default:
            problem = (f"{key.name}={shown(value)} is read only when {scope.switch}="
                       f"{'|'.join(map(str, scope.values))} (here {scope.switch}={state})")
            yield scope.refuse, (f"{problem}; drop {key.name} or change {scope.switch}" if scope.refuse
                                 else f"{problem}; it is ignored")


def scope_problem(cfg: DictConfig) -> str | None:
    """The first key set where another key's value leaves it unread and that is refused (elsewhere: a warning)."""
    return next((line for refused, line in out_of_scope(cfg) if refused), None)
