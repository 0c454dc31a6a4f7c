"""Fixed-length samples over tokenised documents: packed (documents concatenated and cut) or padded (one each).

A sample set is anything with `len()`, `seq_len` and `take(index) -> (input_ids, labels)`, both [B, S] long;
only the rows asked for are read, so memory-mapped documents stay on disk.
"""

from typing import Protocol

import numpy as np
import torch

from parallel.step import IGNORE_INDEX, target_counts
from training.data.encode import Documents
from training.data.spec import PACKED_FORMATS


class Samples(Protocol):
    """Random access to N fixed-length samples."""

    seq_len: int

    def __len__(self) -> int: ...

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def label_counts(self, index: torch.Tensor) -> torch.Tensor: ...


class TensorSamples:
    """Samples held as two [N, S] tensors (tests, small sets)."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape != labels.shape:
            raise ValueError(f"samples must be two [N, S] tensors of equal shape, got {tuple(input_ids.shape)} "
                             f"and {tuple(labels.shape)}")
        self.input_ids, self.labels = input_ids, labels
        self.seq_len = input_ids.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[index].long(), self.labels[index].long()

    def label_counts(self, index: torch.Tensor) -> torch.Tensor:
        """Per sample: the labels that enter the shifted loss."""
        return target_counts(self.labels[index])


def _selection(docs: Documents, doc_ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(start offset in the token file, length) of each selected document, in order."""
    ids = np.arange(len(docs)) if doc_ids is None else np.asarray(doc_ids, np.int64)
    return docs.offsets[ids], docs.offsets[ids + 1] - docs.offsets[ids]


def _labels(ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Labels of token rows: the ids, with -100 where the mask says "not a target"."""
    return ids if mask is None else np.where(mask.astype(bool), ids, IGNORE_INDEX)


class PackedSamples:
    """The selected documents concatenated in order and cut into full seq_len samples (the remainder dropped)."""

    def __init__(self, docs: Documents, seq_len: int, doc_ids: np.ndarray | None = None):
        self.docs, self.seq_len = docs, seq_len
        self.starts, lengths = _selection(docs, doc_ids)
        self.ends = np.cumsum(lengths)  # virtual (concatenated) end position of each selected document
        self.begins = self.ends - lengths
        self.n = int(self.ends[-1]) // seq_len if len(self.ends) else 0

    def __len__(self) -> int:
        return self.n

    def _sources(self, index: torch.Tensor) -> np.ndarray:
        """Token-file offsets of every position of the samples, row after row."""
        positions = (index.numpy()[:, None] * self.seq_len + np.arange(self.seq_len)).ravel()
        doc = np.searchsorted(self.ends, positions, side="right")
        return self.starts[doc] + positions - self.begins[doc]

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        source = self._sources(index)
        ids = np.asarray(self.docs.tokens[source], np.int64)
        mask = None if self.docs.mask is None else np.asarray(self.docs.mask[source])
        shape = (len(index), self.seq_len)
        return torch.from_numpy(ids.reshape(shape)), torch.from_numpy(_labels(ids, mask).reshape(shape))

    def label_counts(self, index: torch.Tensor) -> torch.Tensor:
        """Per sample: the labels that enter the shifted loss; without a mask every position but the first,
        read from nothing (so counting the global batch costs a packed pre-training run nothing)."""
        if self.docs.mask is None:
            return torch.full((len(index),), self.seq_len - 1, dtype=torch.int64)
        mask = np.asarray(self.docs.mask[self._sources(index)]).reshape(len(index), self.seq_len)
        return torch.from_numpy(mask[:, 1:].astype(bool).sum(axis=1).astype(np.int64))


class PaddedSamples:
    """One sample per selected document, right-padded (MiniMind's datasets). Text: `[bos] + tokens[:S-2] + [eos]`,
    labels = ids with pad ids set to -100 (MiniMind's PretrainDataset). Chat: the rendered conversation cut to S
    tokens, labels only on assistant tokens (MiniMind's SFTDataset)."""

    def __init__(self, docs: Documents, seq_len: int, pad_id: int, eos_id: int, doc_ids: np.ndarray | None = None):
        self.docs, self.seq_len, self.pad_id, self.eos_id = docs, seq_len, pad_id, eos_id
        self.starts, self.lengths = _selection(docs, doc_ids)

    def __len__(self) -> int:
        return len(self.starts)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, chat = self.seq_len, self.docs.mask is not None
        ids = np.full((len(index), s), self.pad_id, np.int64)
        labels = np.full((len(index), s), IGNORE_INDEX, np.int64)
        for row, i in enumerate(index.tolist()):
            start, length = int(self.starts[i]), int(self.lengths[i])
            tokens = np.asarray(self.docs.tokens[start:start + min(length, s)], np.int64)
            if not chat and length > s:
                tokens[-1] = self.eos_id  # keep [bos] + tokens[:S-2] + [eos]
            ids[row, :len(tokens)] = tokens
            if chat:
                labels[row, :len(tokens)] = _labels(tokens, self.docs.mask[start:start + len(tokens)])
        if not chat:
            labels = np.where(ids == self.pad_id, IGNORE_INDEX, ids)  # exactly MiniMind's rule
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def label_counts(self, index: torch.Tensor) -> torch.Tensor:
        """Per sample: the labels that enter the shifted loss (reads the rows: a pad id may sit inside a text)."""
        return target_counts(self.take(index)[1])


def make_samples(docs: Documents, fmt: str, seq_len: int, pad_id: int, eos_id: int,
                 doc_ids: np.ndarray | None = None) -> Samples:
    """Packed for "packed" and "chat_packed"; padded for "padded" and "chat" (MiniMind pads its SFT data)."""
    if fmt in PACKED_FORMATS:
        return PackedSamples(docs, seq_len, doc_ids)
    return PaddedSamples(docs, seq_len, pad_id, eos_id, doc_ids)
