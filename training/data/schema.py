"""The run config's data section: where training text comes from and how it becomes fixed-length samples (a
section of the schema, training/config/schema.py, kept beside the data it describes, as each method's section is)."""

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from training.rules.keys import ReadWhen, key
from training.rules.values import at_least, fraction, one_of, optional, positive, seed_value, text

MIB = 1 << 20

SYNTHETIC_ONLY = ReadWhen("data.name", ("synthetic",), refuse=False)
JSONL_ONLY = ReadWhen("data.name", ("jsonl",), refuse=True)


@dataclass
class DataSchema:
    """Where training text comes from and how it becomes fixed-length samples."""

    name: str = key(MISSING, "the data source (the preset sets it): `synthetic` (the embedded corpus) or `jsonl` "
                    "(the rows of `data.path`)", one_of("synthetic", "jsonl"))
    path: Optional[str] = key(
        None, "the training rows (`data=jsonl`), the kind read from the path: a MiniMind JSONL file, a `.parquet` or "
        "`.arrow` file, a `datasets` `save_to_disk` folder, or a Hub dataset `owner/name` (`owner/name:split`); "
        "a `text` column, or `conversations` for the chat formats", read_when=JSONL_ONLY)  # its rows: data_problem
    tokenizer: Optional[str] = key(
        None, "a local tokenizer folder (for example MiniMind's) (`data=jsonl`), or `synthetic` for the embedded "
        "tokenizer (`data.vocab_size` tokens, with the chat template)", read_when=JSONL_ONLY)
    format: Optional[str] = key(
        None, "`packed` (documents concatenated and cut to `seq_len`), `padded` (one document per sample, "
        "MiniMind style) or `chat` (MiniMind's `conversations` rows, loss on assistant tokens only; `chat_packed` "
        "packs them); `null` follows `train.task`: `chat` for `sft`, `dpo` and `distill`, else `padded` for "
        "`data=jsonl` and `packed` for the embedded corpus",
        optional(one_of("packed", "padded", "chat", "chat_packed")))
    num_docs: int = key(4000, "documents in the synthetic corpus", positive, SYNTHETIC_ONLY)
    seed: int = key(0, "seed of the synthetic corpus", seed_value)
    shuffle: bool = key(True, "reshuffle the training samples every epoch (seeded by `train.seed`); `false` keeps "
                              "their order in the data (a curriculum), on every layout alike")
    vocab_size: int = key(2048, "vocabulary of the synthetic corpus's BPE tokenizer",
                          at_least(259), SYNTHETIC_ONLY)  # 256 bytes + 3 special tokens
    cache_dir: str = key(".cache/sluice", "where the synthetic corpus, its tokenizer and tokenised data are cached",
                         text)
    val_path: Optional[str] = key(None, "held-out rows for validation, of any kind `data.path` reads", optional(text))
    val_fraction: float = key(0.0, "fraction of the training data held out for validation (disjoint from training)",
                              fraction())
    skip_bad_lines: bool = key(False, "skip (and count) unusable rows instead of stopping with the file and the "
                                      "line (JSONL) or the 0-based row index (tables)")
    max_line_bytes: int = key(4 * MIB, "longest JSONL line accepted (4 MiB)", positive)
    think: str = key(
        "keep", "the empty `<think>` block MiniMind's chat template writes before a reply without reasoning: `keep` "
        "it, `drop` it, or `minimind` (dropped from 80% of the conversations, as MiniMind's datasets do; drawn per "
        "row from `data.seed`, so every layout and a resumed run see the same samples)",
        one_of("keep", "drop", "minimind"))
    system_prompts: Optional[list[str]] = key(
        None, "system prompts to put before `data.system_ratio` of the SFT conversations that have none (MiniMind's "
        "`pre_processing_chat`; drawn per row from `data.seed`); `null` = none added")
    system_ratio: float = key(0.2, "share of the SFT conversations without a system message that get one of "
                                   "`data.system_prompts` (MiniMind: 0.2)", fraction(closed_top=True))
    open_thinking: bool = key(False, "the chat template's `open_thinking` (MiniMind's switch: an open `<think>`)")
