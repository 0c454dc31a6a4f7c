"""The JSON files a checkpoint or weights folder carries, checked against a schema before any value is used.

`meta.json` (a training checkpoint's step, data position, model and LoRA record) and `model.safetensors.index.json`
(a sharded weights folder's key -> shard map) are data a folder brings with it: a step of -5 would train with a
negative learning rate, a list where an object belongs would end in a traceback. Each is validated with pydantic
(strict types: `true` is no count, `"5"` no number) and refused in one line naming the file and the field. Fields
not named here pass through untouched: other parts of a checkpoint (its owner, checksums) add their own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from checkpoint.errors import CheckpointError

# Steps and sample positions become int64 tensor indices (`torch.arange(position, position + batch)`) and token
# counts (samples x seq_len): 2**48 samples (3e14, far past any run) of up to 2**15 tokens stay inside int64.
MAX_COUNT = 2**48
FORMAT = 1  # meta.json's layout version (the manager writes it)


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class DataPosition(_Schema):
    """Where the data stream stood: global samples consumed, over how many samples, in which seeded order."""

    samples_consumed: int = Field(ge=0, le=MAX_COUNT)
    num_samples: int = Field(ge=1, le=MAX_COUNT)
    seed: int


class LoraRecord(_Schema):
    """The adapters a checkpoint holds (the export divides alpha by rank)."""

    rank: int = Field(ge=1)
    alpha: float
    targets: list[str] | None = None
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    base: str | None = None


class CheckpointMeta(_Schema):
    """A training checkpoint's meta.json."""

    format: int = Field(default=FORMAT, ge=FORMAT, le=FORMAT)
    step: int = Field(ge=0, le=MAX_COUNT)
    data: DataPosition
    model: dict[str, Any]
    layout: dict[str, Any] = {}
    lora: LoraRecord | None = None
    run_id: str | None = Field(default=None, pattern=r"^[0-9A-Za-z]{1,64}$")  # the run that saved it (ownership)
    task: str | None = Field(default=None, pattern=r"^[a-z_]{1,32}$")  # train.task: names the stage's .pth

    @model_validator(mode="after")
    def _position_follows_step(self) -> CheckpointMeta:
        if self.data.samples_consumed < self.step:
            raise ValueError(f"data.samples_consumed={self.data.samples_consumed} is below step={self.step}, but "
                             "every step consumes at least one sample")
        return self


class SafetensorsIndex(_Schema):
    """A sharded safetensors folder's index: every key -> the name of the shard file holding it."""

    weight_map: dict[str, str]


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _problem(error: ValidationError) -> str:
    """The first problem pydantic found, as `field=value: what is wrong`."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    if first["type"] == "missing":
        return f"{where} is missing"
    message = first["msg"].removeprefix("Value error, ")
    if not where:
        return message
    value = first["input"]
    if isinstance(value, (int, float, str, bool)):
        return f"{where}={json.dumps(value)[:60]}: {message}"
    return f"{where} ({_JSON_TYPES.get(type(value), 'an object')}): {message}"


def _validated(schema: type[_Schema], raw: Any, what: str, fix: str) -> _Schema:
    """`raw` checked against `schema`, or one CheckpointError naming `what` and the first bad field."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{what} holds {_JSON_TYPES.get(type(raw), 'a value')}, not a JSON object; {fix}")
    try:
        return schema.model_validate(raw)
    except ValidationError as error:
        raise CheckpointError(f"{what}: {_problem(error)}; {fix}") from None


def checked_meta(raw: Any, path: Path) -> dict[str, Any]:
    """`raw` (the parsed meta.json of the checkpoint at `path`) when it fits the schema; else one line."""
    _validated(CheckpointMeta, raw, f"checkpoint {path}: meta.json",
               "the checkpoint is corrupt or was edited: resume from another one or use checkpoint.resume=none")
    return raw


def step_problem(path: Path, step: int, steps: int) -> str | None:
    """One line when a checkpoint lies past the run's last step (resuming it would train nothing), else None."""
    if step <= steps:
        return None
    return (f"checkpoint {path} is at step {step}, past train.steps={steps}: resuming it would train nothing; "
            f"set train.steps above {step} to continue it, or checkpoint.resume=none to start over")


def index_weight_map(file: Path) -> dict[str, str]:
    """The key -> shard file name map of a `model.safetensors.index.json`, checked; one line when it is not one."""
    fix = "the index is corrupt: write the folder again (save_pretrained)"
    try:
        raw = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"checkpoint.load_dense={file} is not readable JSON ({type(error).__name__}); "
                              f"{fix}") from None
    return _validated(SafetensorsIndex, raw, f"checkpoint.load_dense={file}", fix).weight_map
