"""Data through `datasets` (issue 26): parquet, Arrow files, `save_to_disk` folders and Hub datasets give the token
streams of the same rows in JSONL; a bad table row is named by its index or skipped and counted; a missing column
is one line naming the file and the columns it has; the token cache keys on the source's identity."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from parallel.grid import ParallelGrid
from tests.data_helpers import SMALL, all_samples, data_section, make_cfg, spec, write_jsonl
from tests.equivalence import compose_run_config, run_training
from training.data import DataError, build_data, build_tokenizer, data_problem, data_spec, synthetic_corpus
from training.data.build import source_folder
from training.data.sources import source_kind

TEXTS = synthetic_corpus(48, seed=7)
CONVERSATIONS = [
    [{"role": "system", "content": "you are a kind robot."},
     {"role": "user", "content": f"what is {i} plus 5?"},
     {"role": "assistant", "content": f"{i} plus 5 is {i + 5}."}] if i % 2 else
    [{"role": "user", "content": f"count from {i}."},
     {"role": "assistant", "content": " ".join(str(i + k) for k in range(5)) + "."}]
    for i in range(24)
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(spec(**SMALL, cache_dir=str(tmp_path_factory.mktemp("cache")))).save_pretrained(folder)
    return folder


def write_all(folder: Path, column: str, values: list) -> dict[str, Path]:
    """The same rows (plus an unread "id" column) as JSONL, parquet (several row groups), an Arrow stream file
    (what `datasets` writes), an Arrow IPC file, a `save_to_disk` folder and a saved DatasetDict."""
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(values))), column: values})
    dataset = datasets.Dataset(table)
    paths = {"jsonl": write_jsonl(folder / "rows.jsonl", values, key=column),
             "parquet": folder / "rows.parquet", "arrow": folder / "rows.arrow", "ipc": folder / "rows-ipc.arrow",
             "saved": folder / "saved", "dict": folder / "dict"}
    pq.write_table(table, paths["parquet"], row_group_size=10)
    dataset.save_to_disk(str(paths["saved"]))
    shutil.copy(next(paths["saved"].glob("*.arrow")), paths["arrow"])
    with pa.ipc.new_file(paths["ipc"], table.schema) as writer:
        writer.write_table(table, max_chunksize=7)
    datasets.DatasetDict({"train": dataset, "validation": dataset.select(range(4))}).save_to_disk(str(paths["dict"]))
    return paths


def cfg_for(tmp_path: Path, path: Path | str, tokenizer_dir: Path, fmt: str, seq_len: int = 32, **data):
    return make_cfg(data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format=fmt,
                                 cache_dir=str(tmp_path / "cache"), **data), seq_len=seq_len)


def stream_of(cfg) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Every sample in set order, and the first two steps' micro-batches in stream order."""
    stream, _ = build_data(cfg, 0, 1, verbose=False)
    ids, labels = all_samples(stream)
    return ids, labels, [(mb.input_ids, mb.labels) for step in range(2) for mb in stream.batch(step)]


def assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("fmt, column, values", [("packed", "text", TEXTS), ("chat", "conversations", CONVERSATIONS)])
def test_every_source_gives_the_jsonl_token_stream(tmp_path, tokenizer_dir, fmt, column, values):
    paths = write_all(tmp_path / "data", column, values)
    assert [source_kind(str(p)) for p in paths.values()] == ["jsonl", "parquet", "arrow", "arrow", "saved", "saved"]
    seq_len = 32 if fmt == "packed" else 64
    reference = stream_of(cfg_for(tmp_path, paths["jsonl"], tokenizer_dir, fmt, seq_len))
    assert len(reference[0]) >= 8
    for kind, path in paths.items():
        cfg = cfg_for(tmp_path, path, tokenizer_dir, fmt, seq_len)
        assert data_problem(cfg) is None, kind
        assert_same(stream_of(cfg), reference)
    # Each source has its own cache folder (six sources, one tokenizer).
    assert len(list((tmp_path / "cache" / "tokens").glob("[!.]*"))) == len(paths)


def test_bad_parquet_row_is_named_by_index_or_skipped_and_counted(tmp_path, tokenizer_dir, caplog):
    values = list(TEXTS)
    values[7] = None
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": values}), path, row_group_size=5)
    cfg = cfg_for(tmp_path, path, tokenizer_dir, "packed")
    with pytest.raises(DataError) as error:
        build_data(cfg, 0, 1, verbose=False)
    message = str(error.value)
    assert message.startswith(f'data.path: {path}: row 7: "text" is null; fix or remove the row') and "\n" not in message
    assert "data.skip_bad_lines=true" in message
    assert data_problem(cfg) == message  # the pre-launch check names the same row
    skipping = cfg_for(tmp_path, path, tokenizer_dir, "packed", skip_bad_lines=True)
    assert data_problem(skipping) is None
    with caplog.at_level(logging.WARNING, logger="sluice"):
        stream, _ = build_data(skipping, 0, 1, verbose=False)
    assert stream.skipped_lines == 1
    reports = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert reports == [f'data: skipped 1 bad row(s) of {path} (data.skip_bad_lines=true); first: row 7: "text" is null']
    without = write_jsonl(tmp_path / "without.jsonl", TEXTS[:7] + TEXTS[8:])
    assert_same(stream_of(skipping), stream_of(cfg_for(tmp_path, without, tokenizer_dir, "packed")))


def test_wrongly_typed_column_and_bad_conversation_are_named(tmp_path, tokenizer_dir):
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": list(range(30))}), numbers)
    message = data_problem(cfg_for(tmp_path, numbers, tokenizer_dir, "packed"))
    assert message.startswith(f'data.path: {numbers}: row 0: "text" is a int, not a string')
    chats = list(CONVERSATIONS)
    chats[3] = [{"role": "user", "content": "no reply"}]
    folder = tmp_path / "chats"
    datasets.Dataset.from_dict({"conversations": chats}).save_to_disk(str(folder))
    with pytest.raises(DataError, match=rf"^data.path: {folder}: row 3: no assistant message with content"):
        build_data(cfg_for(tmp_path, folder, tokenizer_dir, "chat", seq_len=64), 0, 1, verbose=False)


def test_missing_column_is_one_line_naming_the_file_and_its_columns(tmp_path, tokenizer_dir):
    paths = write_all(tmp_path / "data", "content", TEXTS)
    for kind in ("parquet", "arrow", "ipc", "saved"):
        path = paths[kind]
        cfg = cfg_for(tmp_path, path, tokenizer_dir, "packed")
        expected = (f'data.path: {path} has no column "text" (its columns: "id", "content"), which '
                    "data.format=packed reads; rename the column or choose the data.format of this data")
        assert data_problem(cfg) == expected
        with pytest.raises(DataError) as error:
            build_data(cfg, 0, 1, verbose=False)
        assert str(error.value) == expected
    chat = data_problem(cfg_for(tmp_path, paths["parquet"], tokenizer_dir, "chat"))
    assert chat.startswith(f'data.path: {paths["parquet"]} has no column "conversations"')


def test_unusable_paths_are_one_line(tmp_path, tokenizer_dir):
    (tmp_path / "plain").mkdir()
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "garbage.arrow").write_bytes(b"not arrow at all")
    cases = {
        tmp_path / "plain": "is not a `datasets` save_to_disk folder",
        tmp_path / "garbage.parquet": "is not a readable parquet file",
        tmp_path / "garbage.arrow": "is not an Arrow file",
        tmp_path / "missing.parquet": "does not exist",
    }
    for path, words in cases.items():
        message = data_problem(cfg_for(tmp_path, path, tokenizer_dir, "packed"))
        assert message.startswith("data.path: ") and words in message and "\n" not in message, message
    folder = tmp_path / "dict"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(str(folder))
    message = data_problem(cfg_for(tmp_path, folder, tokenizer_dir, "packed"))
    assert message == (f"data.path: '{folder}' holds the splits test and no 'train'; point at one split's folder "
                       "(<folder>/<split>)")
    assert data_problem(cfg_for(tmp_path, folder / "test", tokenizer_dir, "packed")) is None


def test_hub_names_load_through_datasets_and_name_a_failure(tmp_path, tokenizer_dir, monkeypatch):
    """A name that is no local path loads with `datasets.load_dataset` (replaced here: no test reaches the network)."""
    calls = []

    def load_dataset(repo, split):
        calls.append((repo, split))
        if repo == "owner/absent":
            raise FileNotFoundError("Dataset 'owner/absent' doesn't exist on the Hub\nmore detail")
        return datasets.Dataset.from_dict({"text": TEXTS})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    reference = stream_of(cfg_for(tmp_path, write_jsonl(tmp_path / "rows.jsonl", TEXTS), tokenizer_dir, "packed"))
    hub = cfg_for(tmp_path, "owner/corpus", tokenizer_dir, "packed", val_path="owner/corpus:validation")
    assert data_problem(hub) is None and calls == []  # the pre-launch check stays offline
    stream, _ = build_data(hub, 0, 1, verbose=False)
    assert torch.equal(all_samples(stream)[0], reference[0])
    assert ("owner/corpus", "train") in calls and ("owner/corpus", "validation") in calls
    with pytest.raises(DataError) as error:
        build_data(cfg_for(tmp_path, "owner/absent", tokenizer_dir, "packed"), 0, 1, verbose=False)
    assert str(error.value) == ("data.path: 'owner/absent' is no local file or folder, and loading it as a Hub dataset "
                                "failed (FileNotFoundError: Dataset 'owner/absent' doesn't exist on the Hub); check "
                                "the path, or the dataset name and the network")
    assert source_kind("owner/missing.jsonl") is None and source_kind(str(tmp_path / "a" / "b")) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert source_kind("data/corpus") is None  # a missing path in a local folder: a typo, not a Hub name


def test_the_cache_keys_on_the_source_and_the_check_writes_nothing(tmp_path, tokenizer_dir):
    paths = write_all(tmp_path / "data", "text", TEXTS)
    tokenizer = build_tokenizer(data_spec(cfg_for(tmp_path, paths["jsonl"], tokenizer_dir, "packed").data))
    before = sorted(p.name for p in tmp_path.iterdir())
    folders = {}
    for kind in ("parquet", "saved"):
        cfg = cfg_for(tmp_path, paths[kind], tokenizer_dir, "packed")
        assert data_problem(cfg) is None
        folders[kind] = source_folder(data_spec(cfg.data), "data.path", tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no cache
    pq.write_table(pa.table({"text": TEXTS[:40]}), paths["parquet"])
    datasets.Dataset.from_dict({"text": TEXTS[:40]}).save_to_disk(str(paths["saved"]))
    for kind in ("parquet", "saved"):
        cfg = cfg_for(tmp_path, paths[kind], tokenizer_dir, "packed")
        assert source_folder(data_spec(cfg.data), "data.path", tokenizer) != folders[kind]  # rewritten: new key
        stream, _ = build_data(cfg, 0, 1, verbose=False)
        assert torch.equal(all_samples(stream)[0], all_samples(build_data(
            cfg_for(tmp_path, write_jsonl(tmp_path / "forty.jsonl", TEXTS[:40]), tokenizer_dir, "packed"), 0, 1,
            verbose=False)[0])[0])


def test_training_on_parquet_gives_the_jsonl_losses(tmp_path, tokenizer_dir):
    paths = {"jsonl": write_jsonl(tmp_path / "rows.jsonl", TEXTS), "parquet": tmp_path / "rows.parquet"}
    pq.write_table(pa.table({"text": TEXTS}), paths["parquet"], row_group_size=16)
    losses = {}
    for kind, path in paths.items():
        cfg = compose_run_config(["model=tiny", "train.seq_len=32", "train.micro_batch_size=2",
                                  "schedule.n_microbatches=2", "train.steps=3", "checkpoint.save_final=false",
                                  "data=jsonl", f"data.path={path}", f"data.tokenizer={tokenizer_dir}",
                                  "data.format=packed"], tmp_path / "cache")
        losses[kind] = run_training(cfg, ParallelGrid.single(torch.device("cpu")), tmp_path / kind)["losses"]
    assert len(losses["jsonl"]) == 3 and losses["parquet"] == losses["jsonl"]
