"""Training data: the embedded synthetic corpus, MiniMind JSONL, the tokenizer, packing and the step stream.

Everything a trainer needs is `build_data(cfg, dp_rank, dp_size) -> (StepBatches, tokenizer)`.
The sample order is a property of the *global* batch, never of the layout: every data-parallel
layout with the same global batch sees the same sequences at the same step (see `StepBatches`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from parallel.step import IGNORE_INDEX, MicroBatch

# MiniMind's special tokens, in id order: 0 = pad/unk, 1 = bos, 2 = eos.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]

# Defaults of the `data` config group; `_get` falls back to these when a key is missing or null.
DATA_DEFAULTS: dict[str, Any] = {
    "name": "synthetic",
    "path": None,
    "tokenizer": None,
    "format": "packed",
    "num_docs": 4000,
    "seed": 0,
    "vocab_size": 2048,
    "cache_dir": ".cache/sluice",
}
# Bump when `synthetic_corpus` changes its output, so cached tokenizers are rebuilt.
CORPUS_VERSION = 1


# --------------------------------------------------------------------------------------------
# Config access


def _get(node: Any, key: str, default: Any = None) -> Any:
    """`node.key` from a DictConfig, a dict or any object; missing or null -> `default`."""
    if node is None:
        return default
    value = node.get(key, default) if isinstance(node, Mapping) else getattr(node, key, default)
    return default if value is None else value


def _data_get(data_cfg: Any, key: str) -> Any:
    """A `data.*` field with its default."""
    return _get(data_cfg, key, DATA_DEFAULTS[key])


# --------------------------------------------------------------------------------------------
# The embedded synthetic corpus

_NOUNS = [  # (singular, plural) subjects: the verb must agree with their number
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"), ("horse", "horses"),
    ("child", "children"), ("man", "men"), ("woman", "women"), ("teacher", "teachers"),
    ("farmer", "farmers"), ("king", "kings"), ("queen", "queens"), ("robot", "robots"),
    ("doctor", "doctors"), ("student", "students"), ("baker", "bakers"), ("sailor", "sailors"),
    ("mouse", "mice"), ("wolf", "wolves"), ("friend", "friends"), ("pilot", "pilots"),
    ("painter", "painters"), ("rabbit", "rabbits"), ("goose", "geese"), ("bear", "bears"),
    ("singer", "singers"), ("driver", "drivers"), ("monkey", "monkeys"), ("lion", "lions"),
    ("nurse", "nurses"),
]
_THINGS = [
    "apple", "ball", "book", "river", "house", "tree", "letter", "song", "door", "car", "boat",
    "map", "key", "lamp", "cake", "box", "garden", "stone", "flower", "window", "bridge", "cup",
    "hat", "chair", "road", "star", "cloud", "coin", "bell", "rope", "shoe", "clock", "bottle",
    "picture", "table", "pencil", "basket", "candle", "ladder", "mirror", "orange", "banana",
    "carrot", "kite", "drum", "ring", "shell", "feather", "wheel", "blanket",
]
_VERBS = [  # transitive: (third person singular, plural)
    ("sees", "see"), ("likes", "like"), ("finds", "find"), ("helps", "help"), ("watches", "watch"),
    ("carries", "carry"), ("opens", "open"), ("paints", "paint"), ("wants", "want"),
    ("takes", "take"), ("holds", "hold"), ("moves", "move"), ("builds", "build"), ("reads", "read"),
    ("cleans", "clean"), ("follows", "follow"), ("drops", "drop"), ("buys", "buy"),
    ("sells", "sell"), ("loves", "love"), ("hides", "hide"), ("brings", "bring"),
]
_INTRANSITIVE = [
    ("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"), ("walks", "walk"),
    ("plays", "play"), ("jumps", "jump"), ("rests", "rest"), ("swims", "swim"), ("dances", "dance"),
    ("laughs", "laugh"), ("works", "work"),
]
_ADJECTIVES = [
    "big", "small", "red", "blue", "green", "old", "young", "happy", "quiet", "bright", "dark",
    "tall", "short", "warm", "cold", "fast", "slow", "kind", "brave", "clever", "yellow", "heavy",
    "light", "soft", "loud", "busy", "tired", "funny", "gentle", "proud",
]
_PLACES = [
    "in the garden", "near the river", "at home", "under the tree", "on the hill", "by the sea",
    "in the city", "at school", "in the forest", "on the bridge", "behind the house", "in the park",
]
_TIMES = ["today", "every day", "at night", "in the morning", "after lunch", "in the winter"]


def _noun_phrase(rng: random.Random, noun: str) -> str:
    """'the [adjective] noun'."""
    return f"the {rng.choice(_ADJECTIVES)} {noun}" if rng.random() < 0.5 else f"the {noun}"


def _grammar_sentence(rng: random.Random) -> str:
    """A templated English sentence whose verb agrees with its subject."""
    plural = rng.random() < 0.5
    subject = _noun_phrase(rng, rng.choice(_NOUNS)[plural])
    kind = rng.randrange(4)
    if kind == 0:
        return f"{subject} {rng.choice(_VERBS)[plural]} {_noun_phrase(rng, rng.choice(_THINGS))}."
    if kind == 1:
        tail = f" {rng.choice(_TIMES)}" if rng.random() < 0.3 else ""
        return f"{subject} {rng.choice(_INTRANSITIVE)[plural]} {rng.choice(_PLACES)}{tail}."
    if kind == 2:
        return f"{subject} {'are' if plural else 'is'} {rng.choice(_ADJECTIVES)}."
    # A pronoun that must agree with the subject of the previous clause.
    pronoun = "they" if plural else "it"
    return (f"{subject} {rng.choice(_INTRANSITIVE)[plural]} {rng.choice(_PLACES)}. "
            f"{pronoun} {rng.choice(_VERBS)[plural]} the {rng.choice(_THINGS)}.")


def _arithmetic_fact(rng: random.Random) -> str:
    """A correct arithmetic fact such as '17 plus 5 is 22.'."""
    op = rng.randrange(3)
    if op == 0:
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        return f"{a} plus {b} is {a + b}."
    if op == 1:
        a = rng.randint(0, 40)
        b = rng.randint(0, a)
        return f"{a} minus {b} is {a - b}."
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a} times {b} is {a * b}."


def _counting(rng: random.Random) -> str:
    """A counting run such as 'counting: 3 4 5 6 7.' (step 1 or 2)."""
    start, step, length = rng.randint(0, 60), rng.choice((1, 1, 2)), rng.randint(3, 10)
    return "counting: " + " ".join(str(start + step * i) for i in range(length)) + "."


def _document(rng: random.Random) -> str:
    """One document of roughly 20-200 words: stated facts, mixed sentences, recalled facts."""
    target_words = rng.randint(20, 200)
    # Key-value facts stated early and repeated verbatim later: in-context recall.
    keys = rng.sample(_THINGS, rng.randint(1, 3)) if rng.random() < 0.5 else []
    facts = [f"the code of {key} is {rng.randint(10, 99)}." for key in keys]
    sentences = list(facts)
    words = sum(len(s.split()) for s in sentences)
    while words < target_words:
        r = rng.random()
        if facts and r < 0.15:
            sentence = rng.choice(facts)
        elif r < 0.6:
            sentence = _grammar_sentence(rng)
        elif r < 0.8:
            sentence = _arithmetic_fact(rng)
        else:
            sentence = _counting(rng)
        sentences.append(sentence)
        words += len(sentence.split())
    return " ".join(sentences)


def synthetic_corpus(num_docs: int, seed: int) -> list[str]:
    """`num_docs` deterministic documents with learnable structure (grammar, arithmetic, counting, recall)."""
    rng = random.Random(seed)
    return [_document(rng) for _ in range(num_docs)]


# --------------------------------------------------------------------------------------------
# Tokenizer


def synthetic_tokenizer_dir(data_cfg: Any) -> Path:
    """Cache folder of the tokenizer trained on the synthetic corpus of `data_cfg`."""
    name = (f"tokenizer-synthetic-v{CORPUS_VERSION}-seed{_data_get(data_cfg, 'seed')}"
            f"-docs{_data_get(data_cfg, 'num_docs')}-vocab{_data_get(data_cfg, 'vocab_size')}")
    return Path(_data_get(data_cfg, "cache_dir")) / name


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A MiniMind-style byte-level BPE tokenizer (specials 0/1/2) trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # listed first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unk
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=PAD_TOKEN,
    )


def _save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save into a temporary sibling folder and rename it into place; a concurrent winner is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)  # atomic; fails if another process already put a full folder there
    except OSError:
        if not (target / "tokenizer.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """A local tokenizer folder (never the network), with MiniMind's specials where it has none."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    missing = {
        attr: token
        for attr, token in (("bos_token", BOS_TOKEN), ("eos_token", EOS_TOKEN), ("pad_token", PAD_TOKEN))
        if getattr(tokenizer, attr) is None
    }
    if missing:
        tokenizer.add_special_tokens(missing)  # reuses the ids when the tokens are in the vocab
    return tokenizer


def build_tokenizer(data_cfg: Any) -> PreTrainedTokenizerBase:
    """The tokenizer of `data_cfg`: trained once and cached for "synthetic", loaded for "jsonl"."""
    name = _data_get(data_cfg, "name")
    if name == "jsonl":
        folder = _data_get(data_cfg, "tokenizer")
        if folder is None:
            raise ValueError("data.tokenizer: not set; pass data.tokenizer=<folder with tokenizer.json>")
        return _load_tokenizer(folder)
    if name != "synthetic":
        raise ValueError(f"data.name: unknown data set '{name}'; use data.name=synthetic or data.name=jsonl")
    folder = synthetic_tokenizer_dir(data_cfg)
    if not (folder / "tokenizer.json").exists():
        corpus = synthetic_corpus(_data_get(data_cfg, "num_docs"), _data_get(data_cfg, "seed"))
        _save_atomically(train_bpe_tokenizer(corpus, _data_get(data_cfg, "vocab_size")), folder)
    return _load_tokenizer(folder)


def load_tokenizer_vocab_size(cfg: Any) -> int:
    """Number of token ids the tokenizer of `cfg.data` can produce (the model's vocab must cover it)."""
    return len(build_tokenizer(_get(cfg, "data")))


# --------------------------------------------------------------------------------------------
# Texts -> fixed-length samples


def load_texts(data_cfg: Any) -> datasets.Dataset:
    """The documents of `data_cfg` as a `datasets.Dataset` with a "text" column."""
    if _data_get(data_cfg, "name") == "jsonl":
        cache = Path(_data_get(data_cfg, "cache_dir")) / "datasets"
        return datasets.load_dataset(
            "json", data_files=str(_data_get(data_cfg, "path")), split="train", cache_dir=str(cache)
        )
    corpus = synthetic_corpus(_data_get(data_cfg, "num_docs"), _data_get(data_cfg, "seed"))
    return datasets.Dataset.from_dict({"text": corpus})


def encode_samples(
    texts: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, seq_len: int, fmt: str = "packed"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize a "text" data set into `(input_ids, labels)`, both [N, seq_len] long.

    "padded" (MiniMind's): one document per sample, `[bos] + tokens[:seq_len-2] + [eos]`, right-padded
    with pad; labels are input_ids with pads set to -100.
    "packed": `[bos] + tokens + [eos]` of every document concatenated and cut into full chunks of
    seq_len (remainder dropped); labels are input_ids.
    """
    if fmt not in ("packed", "padded"):
        raise ValueError(f"data.format: unknown format '{fmt}'; use data.format=packed or data.format=padded")
    if seq_len < 2:
        raise ValueError(f"train.seq_len: {seq_len} is too short; a sample needs at least 2 tokens")
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id

    def encode(batch: dict[str, list]) -> dict[str, list[list[int]]]:
        texts_ = [str(t) for t in batch["text"]]
        if fmt == "padded":
            ids = tokenizer(texts_, add_special_tokens=False, truncation=True, max_length=seq_len - 2)["input_ids"]
            return {"input_ids": [[bos, *x, eos] + [pad] * (seq_len - 2 - len(x)) for x in ids]}
        ids = tokenizer(texts_, add_special_tokens=False)["input_ids"]
        return {"input_ids": [[bos, *x, eos] for x in ids]}

    encoded = texts.map(encode, batched=True, remove_columns=texts.column_names, desc="tokenizing")
    # Flatten the list column in Arrow (one copy) rather than row by row in Python.
    flat = pc.list_flatten(encoded.data.column("input_ids")).to_numpy(zero_copy_only=False)
    stream = torch.from_numpy(np.asarray(flat, dtype=np.int64).copy())
    if fmt == "packed":
        n = stream.numel() // seq_len
        input_ids = stream[: n * seq_len].view(n, seq_len)
        return input_ids, input_ids  # no padding: every token is a label; shared, never written
    input_ids = stream.view(-1, seq_len)
    labels = input_ids.masked_fill(input_ids == pad, IGNORE_INDEX)  # exactly MiniMind's rule
    return input_ids, labels


# --------------------------------------------------------------------------------------------
# The step stream


class StepBatches:
    """Infinite iterator over optimizer steps: each `next()` is this DP replica's `list[MicroBatch]`.

    Global order contract (what makes layouts numerically equivalent): epoch e is
    `randperm(N, Generator(seed + e))`; the global stream is the concatenation of epochs; step k
    consumes global sequences [k*G, (k+1)*G) with G = dp_size * n_microbatches * micro_batch_size;
    replica d takes [k*G + d*M, k*G + (d+1)*M) with M = n_microbatches * micro_batch_size, split in
    order into micro-batches. So the stream depends on G only, not on how G is split.
    """

    def __init__(
        self,
        samples_input_ids: torch.Tensor,
        samples_labels: torch.Tensor,
        micro_batch_size: int,
        n_microbatches: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        if samples_input_ids.dim() != 2 or samples_input_ids.shape != samples_labels.shape:
            raise ValueError(
                f"samples must be two [N, S] tensors of equal shape, got {tuple(samples_input_ids.shape)} "
                f"and {tuple(samples_labels.shape)}"
            )
        if micro_batch_size < 1 or n_microbatches < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and n_microbatches ({n_microbatches}) must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.input_ids, self.labels = samples_input_ids, samples_labels
        self.micro_batch_size, self.n_microbatches = micro_batch_size, n_microbatches
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.replica_batch_size = n_microbatches * micro_batch_size  # M
        self.global_batch_size = dp_size * self.replica_batch_size  # G
        self.num_samples, self.seq_len = samples_input_ids.shape
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"the data set has {self.num_samples} sequences of {self.seq_len} tokens, fewer than one global "
                f"batch of {self.global_batch_size} = dp {dp_size} x schedule.n_microbatches {n_microbatches} x "
                f"train.micro_batch_size {micro_batch_size}; use more data (data.num_docs or a larger "
                f"data.path), a shorter train.seq_len, or a smaller global batch"
            )
        self.step = 0  # the next step to yield
        self._perms: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of `epoch`; only the two most recent epochs are kept."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perms[epoch] = torch.randperm(self.num_samples, generator=generator)
        return self._perms[epoch]

    def sample_indices(self, step: int) -> torch.Tensor:
        """Indices (into the samples) of the M sequences this replica consumes at `step`."""
        start = step * self.global_batch_size + self.dp_rank * self.replica_batch_size
        positions = torch.arange(start, start + self.replica_batch_size)
        epochs, offsets = positions // self.num_samples, positions % self.num_samples
        # A step may straddle an epoch boundary (M <= N, so at most two epochs).
        return torch.cat([self._permutation(int(e))[offsets[epochs == e]] for e in epochs.unique()])

    def batch(self, step: int) -> list[MicroBatch]:
        """This replica's micro-batches of `step` (random access; does not move the iterator)."""
        index = self.sample_indices(step)
        input_ids, labels = self.input_ids[index].long(), self.labels[index].long()
        b = self.micro_batch_size
        return [MicroBatch(input_ids[i : i + b], labels[i : i + b]) for i in range(0, self.replica_batch_size, b)]

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return self

    def __next__(self) -> list[MicroBatch]:
        micro_batches = self.batch(self.step)
        self.step += 1
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        """The resume position: the number of steps already consumed."""
        return {"step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()` position (valid across layouts with the same global batch)."""
        self.step = int(state["step"])


# --------------------------------------------------------------------------------------------
# Entry points for the trainer and config validation


def check_data(cfg: Any) -> str | None:
    """A one-line error for a `data` config that cannot work, or None; cheap (reads one line, tokenizes nothing)."""
    data_cfg = _get(cfg, "data")
    name, fmt = _data_get(data_cfg, "name"), _data_get(data_cfg, "format")
    if name not in ("synthetic", "jsonl"):
        return f"data.name: unknown data set '{name}'; use data.name=synthetic or data.name=jsonl"
    if fmt not in ("packed", "padded"):
        return f"data.format: unknown format '{fmt}'; use data.format=packed or data.format=padded"
    if name == "synthetic":
        if int(_data_get(data_cfg, "num_docs")) < 1:
            return "data.num_docs: must be >= 1"
        if int(_data_get(data_cfg, "vocab_size")) < 256 + len(SPECIAL_TOKENS):
            return f"data.vocab_size: must be >= {256 + len(SPECIAL_TOKENS)} (256 bytes + 3 special tokens)"
        return None

    path = _data_get(data_cfg, "path")
    hint = "pass data.path=<a MiniMind pretraining .jsonl file>"
    if path is None:
        return f"data.path: not set; {hint}"
    if not os.path.isfile(path):
        return f"data.path: file '{path}' does not exist; {hint}"
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError as e:
        return f"data.path: first line of '{path}' is not JSON ({e.msg}); expected one {{\"text\": ...}} object per line"
    if not isinstance(record, dict) or "text" not in record:
        return f"data.path: first line of '{path}' has no \"text\" key; expected one {{\"text\": ...}} object per line"

    folder = _data_get(data_cfg, "tokenizer")
    hint = "pass data.tokenizer=<folder with tokenizer.json>"
    if folder is None:
        return f"data.tokenizer: not set; {hint}"
    if not os.path.isdir(folder):
        return f"data.tokenizer: folder '{folder}' does not exist; {hint}"
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return f"data.tokenizer: folder '{folder}' has neither tokenizer.json nor tokenizer_config.json; {hint}"
    return None


def build_data(cfg: Any, dp_rank: int, dp_size: int) -> tuple[StepBatches, PreTrainedTokenizerBase]:
    """The step stream of DP replica `dp_rank` of `dp_size`, and the tokenizer, from the whole run config."""
    problem = check_data(cfg)
    if problem is not None:
        raise ValueError(problem)
    data_cfg, train_cfg = _get(cfg, "data"), _get(cfg, "train")
    tokenizer = build_tokenizer(data_cfg)
    input_ids, labels = encode_samples(
        load_texts(data_cfg), tokenizer, int(_get(train_cfg, "seq_len")), _data_get(data_cfg, "format")
    )
    stream = StepBatches(
        input_ids,
        labels,
        micro_batch_size=int(_get(train_cfg, "micro_batch_size")),
        n_microbatches=int(_get(_get(cfg, "schedule"), "n_microbatches")),
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=int(_get(train_cfg, "seed", 0)),
    )
    return stream, tokenizer
