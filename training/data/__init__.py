"""Training data: the synthetic corpus or rows (text or chat) from JSONL, parquet, Arrow, a `save_to_disk` folder or
the Hub, the tokenizer, a memory-mapped token cache, packed or padded samples, the held-out split and the DP step
stream.

The trainer needs `build_data(cfg, dp_rank, dp_size) -> (StepBatches, tokenizer)` and, for evaluation,
`build_val_batches(cfg, dp_rank, dp_size, n_batches)`; config validation needs `data_problem(cfg)`.
The sample order is a property of the *global* batch, never of the layout (see `StepBatches`).
"""

from parallel.step import IGNORE_INDEX, MicroBatch
from training.data.build import build_data, build_splits, build_val_batches, load_tokenizer_vocab_size, source_documents
from training.data.validate import data_problem
from training.data.corpus import synthetic_corpus
from training.data.encode import Documents, encode_conversations, encode_texts
from training.data.samples import PackedSamples, PaddedSamples, TensorSamples
from training.data.spec import DataError, DataSpec, Geometry, data_spec, geometry, run_data_spec
from training.data.split import split_documents
from training.data.stream import StepBatches
from training.data.tokenizer import (BOS_TOKEN, CHATML_TEMPLATE, EOS_TOKEN, PAD_TOKEN, build_tokenizer, load_tokenizer,
                                     save_atomically, synthetic_tokenizer_dir, train_bpe_tokenizer,
                                     weights_tokenizer_problem)

__all__ = [
    "BOS_TOKEN", "CHATML_TEMPLATE", "EOS_TOKEN", "IGNORE_INDEX", "PAD_TOKEN", "DataError", "DataSpec", "Documents",
    "Geometry", "MicroBatch", "PackedSamples", "PaddedSamples", "StepBatches", "TensorSamples", "build_data",
    "build_splits", "build_tokenizer", "build_val_batches", "data_problem", "data_spec", "encode_conversations",
    "encode_texts", "geometry", "load_tokenizer", "load_tokenizer_vocab_size", "save_atomically",
    "run_data_spec", "source_documents", "split_documents", "synthetic_corpus", "synthetic_tokenizer_dir",
    "train_bpe_tokenizer", "weights_tokenizer_problem",
]
