"""The data config as a typed, frozen spec, the batch geometry the data serves, and the data error type."""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from training.data.chat_rules import ChatRules
from training.data.schema import DataSchema  # the home of the chat keys' defaults

NAMES = ("synthetic", "jsonl")
FORMATS = ("packed", "padded", "chat", "chat_packed")  # chat: MiniMind conversations
PACKED_FORMATS = ("packed", "chat_packed")


class DataError(ValueError):
    """Bad data, data config or tokenizer; the message is one line naming the file (and line) and the fix."""


@dataclass(frozen=True)
class DataSpec:
    """The `data` config section and the run's train.task; defaults live only in the config schema
    (training/config/schema.py), but for `train_task` outside a run config (tests, scripts): pretraining."""

    name: str
    path: str | None
    tokenizer: str | None
    format: str
    num_docs: int
    seed: int
    shuffle: bool
    vocab_size: int
    cache_dir: str
    val_path: str | None
    val_fraction: float
    skip_bad_lines: bool
    max_line_bytes: int
    think: str  # the empty think block of chat rows (training.data.chat_rules)
    system_prompts: tuple[str, ...]
    system_ratio: float
    open_thinking: bool = False  # the chat template's `open_thinking` (MiniMind's switch)
    train_task: str = "pretrain"  # train.task: "dpo" reads preference pairs

    @property
    def chat(self) -> bool:
        """True when rows are MiniMind conversations rendered with the chat template (pairs of them under DPO)."""
        return self.format.startswith("chat")

    @property
    def chat_rules(self) -> ChatRules:
        """How chat rows are prepared before tokenising (think block, system prompts), seeded by data.seed."""
        return ChatRules(self.think, self.system_prompts, self.system_ratio, self.seed, self.open_thinking)

    @property
    def preference(self) -> bool:
        """True when each row is a DPO pair: a chosen and a rejected conversation, two samples side by side."""
        return self.train_task == "dpo"

    @property
    def task(self) -> str:
        """The task whose columns each row must hold (a key of training.data.rows.TASKS)."""
        if self.train_task == "grpo":  # prompts: conversations up to their last user turn
            return "prompt"
        return "dpo" if self.preference else "chat" if self.chat else "text"


@dataclass(frozen=True)
class Geometry:
    """What one step consumes: dp x n_microbatches x micro_batch_size sequences of seq_len tokens."""

    seq_len: int
    micro_batch_size: int
    n_microbatches: int
    seed: int  # shuffles the sample order (train.seed)
    rows_per_sample: int = 1  # sequences of one sample: 2 for a preference pair (chosen, rejected)

    @property
    def samples_per_micro_batch(self) -> int:
        """Samples (pairs under DPO) in one micro-batch of micro_batch_size sequences."""
        return self.micro_batch_size // self.rows_per_sample

    def global_batch(self, dp: int) -> int:
        """Samples (sequences; pairs under DPO) in one global batch for `dp` replicas."""
        return dp * self.n_microbatches * self.samples_per_micro_batch


def _field(node: Any, key: str, section: str) -> Any:
    """`node[key]` from a DictConfig or dict, or `node.key` from any object; missing -> DataError."""
    try:
        return node[key] if isinstance(node, Mapping) else getattr(node, key)
    except (KeyError, AttributeError):
        raise DataError(f"{section}.{key}: missing from the config; it belongs in the config schema") from None


def section(cfg: Any, key: str) -> Any:
    """A section (`data`, `train`, ...) of a run config given as a DictConfig, a dict or an object."""
    return _field(cfg, key, "cfg")


def optional_field(node: Any, key: str) -> Any:
    """`node.key`, or None when the node or the key is absent."""
    try:
        return None if node is None else _field(node, key, "cfg")
    except DataError:
        return None


def default_format(name: str, train_task: str) -> str:
    """`data.format` when the config leaves it null: conversations (`chat`) for sft, dpo and distill (MiniMind distills
    on its SFT data); for pretraining one padded document per sample from files (MiniMind's PretrainDataset), packed
    documents from the embedded corpus."""
    if train_task in ("sft", "dpo", "distill", "grpo"):
        return "chat"
    return "padded" if name == "jsonl" else "packed"


def data_spec(node: Any, train_task: str = "pretrain") -> DataSpec:
    """A DataSpec from the `data` section (a DictConfig, a dict or an object) and the run's train.task; a DataSpec
    passes through. A null `format` follows the task (`default_format`)."""
    if isinstance(node, DataSpec):
        return node
    optional = {"think", "system_prompts", "system_ratio", "open_thinking"}  # a section without them (an older run's) takes defaults
    values = {f.name: _field(node, f.name, "data") for f in fields(DataSpec)
              if f.name != "train_task" and f.name not in optional}
    for name in optional:
        value = optional_field(node, name)
        value = getattr(DataSchema(), name) if value is None else value
        values[name] = tuple(str(p) for p in value or ()) if name == "system_prompts" else value
    values["format"] = values["format"] or default_format(values["name"], train_task)
    return DataSpec(**values, train_task=train_task)


def train_task(cfg: Any) -> str:
    """The run's train.task (pretraining where a config has none: tests, older configs)."""
    return optional_field(optional_field(cfg, "train"), "task") or "pretrain"


def run_data_spec(cfg: Any) -> DataSpec:
    """The DataSpec of a whole run config: its `data` section read for its train.task."""
    return data_spec(section(cfg, "data"), train_task(cfg))


def rows_per_sample(cfg: Any) -> int:
    """Sequences one sample stands for: a DPO pair's two, a GRPO prompt's group of completions, else one."""
    task = train_task(cfg)
    if task == "grpo":  # the group size: the schema gives every GRPO config one
        return int(_field(section(cfg, "grpo"), "num_generations", "grpo"))
    return 2 if task == "dpo" else 1


def geometry(cfg: Any) -> Geometry:
    """The batch geometry of a whole run config (train.* and schedule.n_microbatches)."""
    train, schedule = section(cfg, "train"), section(cfg, "schedule")
    return Geometry(seq_len=int(_field(train, "seq_len", "train")),
                    micro_batch_size=int(_field(train, "micro_batch_size", "train")),
                    n_microbatches=int(_field(schedule, "n_microbatches", "schedule")),
                    seed=int(_field(train, "seed", "train")), rows_per_sample=rows_per_sample(cfg))
