"""A folder's metadata is checked before use (issue 35, item 3): meta.json, safetensors headers, index files and DCP
metadata with values no writer produces are refused in one line naming the file and the field or key."""

import hashlib
import json
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint.dense import CheckpointError, check_dense_files, load_dense_into, read_dense_state_dict
from checkpoint.dense_source import dense_source
from checkpoint.export import read_training_weights
from checkpoint.manager import META, resume_problem
from checkpoint.safe_reader import METADATA_FILE, RestrictedUnpickler
from minimind import MiniMindConfig, MiniMindForCausalLM
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training
from training.config import ConfigError
from training.config.validate import validate
from training.data import StepBatches, TensorSamples
from training.data.spec import DataError

BASE = ["model=tiny", "train.steps=1", "schedule.n_microbatches=1", "checkpoint.save_final=true"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step, one-process checkpoint (the data cache beside it)."""
    root = tmp_path_factory.mktemp("meta")
    run_training(compose_run_config(BASE, root / "cache"), ParallelGrid.single("cpu"), root / "run")
    return root, root / "run" / "checkpoints" / "step_00000001"


def tampered(checkpoint: Path, target: Path, edit) -> Path:
    """A copy of the checkpoint whose meta.json is `edit(meta)` (edit returns the new JSON value), its recorded
    checksum rewritten too, as whoever edits a file can: checksums catch corruption, the schema catches values."""
    shutil.copytree(checkpoint, target)
    (target / META).write_text(json.dumps(edit(json.loads((target / META).read_text()))))
    sums = target / "SHA256SUMS"
    if sums.exists():
        digest = hashlib.sha256((target / META).read_bytes()).hexdigest()
        sums.write_text("".join(f"{digest}  {META}\n" if line.endswith(f"  {META}") else f"{line}\n"
                                for line in sums.read_text().splitlines()))
    return target


def with_field(path: str, value):
    """An edit setting the dotted `path` of meta.json to `value` (None: removing it)."""
    def edit(meta: dict) -> dict:
        *parents, last = path.split(".")
        node = meta
        for key in parents:
            node = node[key]
        if value is None:
            del node[last]
        else:
            node[last] = value
        return meta
    return edit


# (edit, text the one line holds): every value a writer never produces.
TAMPERED = {
    "step -5": (with_field("step", -5), r"meta.json: step=-5: Input should be greater than or equal to 0"),
    "step 10^9": (with_field("step", 10**9), r"samples_consumed=\d+ is below step=1000000000"),
    "negative position": (with_field("data.samples_consumed", -8), r"data.samples_consumed=-8: Input should be"),
    "a list": (lambda meta: [meta], r"meta.json holds an array, not a JSON object"),
    "a string": (lambda meta: "step 1", r"meta.json holds a string, not a JSON object"),
    "no step": (with_field("step", None), r"meta.json: step is missing"),
    "no data": (with_field("data", None), r"meta.json: data is missing"),
    "no seed": (with_field("data.seed", None), r"meta.json: data.seed is missing"),
    "step true": (with_field("step", True), r"meta.json: step=true: Input should be a valid integer"),
    "step '1'": (with_field("step", "1"), r'meta.json: step="1": Input should be a valid integer'),
    "model a list": (with_field("model", [1]), r"meta.json: model \(an array\): Input should be a valid dictionary"),
    "lora rank 0": (with_field("lora", {"rank": 0, "alpha": 1.0}), r"meta.json: lora.rank=0"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_meta_json_is_one_line_before_launch(saved, tmp_path, case):
    root, checkpoint = saved
    edit, message = TAMPERED[case]
    bad = tampered(checkpoint, tmp_path / "step_00000001", edit)
    problem = resume_problem(str(bad), None, {})
    assert problem is not None and "\n" not in problem and str(bad) in problem, problem
    assert re.search(message, problem), problem


def test_a_checkpoint_past_train_steps_is_refused_before_launch(saved, tmp_path):
    root, checkpoint = saved
    far = tampered(checkpoint, tmp_path / "step_00000001",
                   lambda meta: {**meta, "step": 10**9, "data": {**meta["data"], "samples_consumed": 2 * 10**9}})
    with pytest.raises(ConfigError, match=r"is at step 1000000000, past train.steps=1: resuming it would train "
                                          r"nothing; set train.steps above 1000000000"):
        validate(compose_run_config([*BASE, f"checkpoint.resume={far}"], root / "cache"))


def test_a_negative_step_never_trains(saved, tmp_path):
    """It trained steps -5..5 with a negative learning rate (gradient ascent); the resume now refuses it."""
    root, checkpoint = saved
    bad = tampered(checkpoint, tmp_path / "step_00000001", with_field("step", -5))
    cfg = compose_run_config([*BASE, "train.steps=3", f"checkpoint.resume={bad}"], root / "cache")
    with pytest.raises(CheckpointError, match=r"meta.json: step=-5"):
        run_training(cfg, ParallelGrid.single("cpu"), tmp_path / "resumed")
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


def test_train_py_exits_2_for_a_tampered_step(saved, tmp_path, monkeypatch, capsys):
    """train.py's pre-launch check, through its entry point in this process (it ends before Hydra runs)."""
    from tests.test_config_errors import train_py_here

    root, checkpoint = saved
    bad = tampered(checkpoint, tmp_path / "step_00000001", with_field("step", -5))
    out = train_py_here([*BASE, f"checkpoint.resume={bad}", "logger=none", f"data.cache_dir={root / 'cache'}",
                         f"hydra.run.dir={tmp_path / 'again'}"], monkeypatch, capsys)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "meta.json: step=-5" in lines[0] and "Traceback" not in out.stderr, lines
    assert not (tmp_path / "again").exists()


def test_export_refuses_a_meta_json_that_is_a_list(saved, tmp_path):
    _, checkpoint = saved
    bad = tampered(checkpoint, tmp_path / "step_00000001", lambda meta: [meta])
    with pytest.raises(CheckpointError, match=r"meta.json holds an array, not a JSON object"):
        read_training_weights(bad)


@pytest.mark.parametrize("position", [-8, 2.5, True, "8"])
def test_the_data_stream_refuses_a_position_that_is_no_count(position):
    ids = torch.arange(60).view(20, 3)
    stream = StepBatches(TensorSamples(ids, ids.clone()), 2, 2, seed=1)
    with pytest.raises(DataError, match=r"samples_consumed=.* is not a count of samples"):
        stream.load_state_dict({"samples_consumed": position, "num_samples": 20, "seed": 1})


def test_dcp_metadata_whose_chunk_leaves_its_tensor_is_refused(saved, tmp_path):
    """Values the allow-list admits (plain torch.Size, ints) but no writer produces: a chunk outside its tensor."""
    from checkpoint.distributed import read_keys
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _, checkpoint = saved
    bad = tmp_path / "step_00000001"
    shutil.copytree(checkpoint, bad)
    metadata = RestrictedUnpickler(open(bad / METADATA_FILE, "rb"), bad).load()
    key = "model.embed_tokens.weight"
    entry = metadata.state_dict_metadata[key]
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([8, 0]), sizes=entry.chunks[0].sizes)]
    (bad / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=rf"{key} has a chunk at \[8, 0\] of size \[2048, 64\] outside its size"):
        read_keys(bad)


def test_dcp_metadata_with_overlapping_chunks_bad_storage_or_a_huge_size_is_refused(saved, tmp_path):
    from checkpoint.distributed import read_keys
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    _, checkpoint = saved
    key = "model.embed_tokens.weight"
    for case in ("overlap", "negative", "huge"):
        bad = tmp_path / case / "step_00000001"
        shutil.copytree(checkpoint, bad)
        metadata = RestrictedUnpickler(open(bad / METADATA_FILE, "rb"), bad).load()
        entry = metadata.storage_data[MetadataIndex(key, torch.Size([0, 0]))]
        if case == "overlap":  # two halves that share rows 1000..1023, and leave the last 24 rows out
            halves = [(0, 1024), (1000, 1024)]
            metadata.state_dict_metadata[key].chunks = [
                ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([rows, 64])) for start, rows in halves]
            for start, _ in halves:
                metadata.storage_data[MetadataIndex(key, torch.Size([start, 0]))] = entry
            message = rf"{key} has chunks at \[0, 0\] and \[1000, 0\] that overlap"
        elif case == "negative":
            metadata.storage_data[MetadataIndex(key, torch.Size([0, 0]))] = _StorageInfo(entry.relative_path, -5,
                                                                                         entry.length)
            message = rf"the storage entry of '{key}' is not a file name with a non-negative offset and length"
        else:  # 10^12 elements the export would allocate (4 TB), stored in the bytes of 131072
            metadata.state_dict_metadata[key].size = torch.Size([10**6, 10**6])
            metadata.state_dict_metadata[key].chunks = [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                             torch.Size([10**6, 10**6]))]
            message = rf"{key} has a chunk at \[0, 0\] of 1000000000000 elements stored in \d+ bytes"
        (bad / METADATA_FILE).write_bytes(pickle.dumps(metadata))
        with pytest.raises(CheckpointError, match=message):
            read_keys(bad)


# Safetensors files written by hand: a header (JSON after its 8-byte length) and zeroed data.
def handmade(path: Path, header, data_bytes: int, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(data_bytes))
    return path


def tensor(dtype: str, shape: list, start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


W, SHAPE = "model.norm.weight", (64,)
CRAFTED = {  # (header, data bytes, header length or None, what the one line holds)
    "overlapping offsets": ({W: tensor("F32", [64], 0, 256), "extra": tensor("F32", [64], 128, 384)}, 384, None,
                            r"invalid offset for tensor `extra`"),
    "a negative shape": ({W: tensor("F32", [-1, 64], 0, 256)}, 256, None, rf"\(key {W}\): .*integer `-1`"),
    "an unknown dtype": ({W: tensor("Q7", [64], 0, 256)}, 256, None, rf"\(key {W}\): .*unknown variant `Q7`"),
    "a 2^62 header": ({W: tensor("F32", [64], 0, 256)}, 256, 2**62, r"header too large"),
    "a truncated file": ({W: tensor("F32", [64], 0, 256)}, 100, None, r"incomplete metadata, file not fully covered"),
    "a size its bytes disagree with": ({W: tensor("F32", [65], 0, 256)}, 256, None, r"invalid shape, data type"),
    # found by a 30-minute fuzz soak: the key's newline broke the one line; it is shown escaped
    "a key holding a newline": ({"\n": None}, 0, None, r"\(key '\\n'\): invalid JSON in header"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_safetensors_file_is_one_line_on_both_paths(tmp_path, case):
    header, data_bytes, length, message = CRAFTED[case]
    path = handmade(tmp_path / "model.safetensors", header, data_bytes, length)
    pattern = rf"checkpoint.load_dense={path} is not a valid safetensors file.*{message}.*write it again"
    with pytest.raises(CheckpointError, match=pattern):
        dense_source(path, {W: SHAPE}, {})
    with pytest.raises(CheckpointError, match=pattern):
        read_dense_state_dict(path)
    with pytest.raises(CheckpointError, match=pattern):  # a folder holding it: the same refusal
        read_dense_state_dict(tmp_path)
    for before_launch in (path, tmp_path):  # preflight's check reads the header: exit 2, no worker started
        with pytest.raises(CheckpointError, match=pattern):
            check_dense_files(before_launch)


def test_integer_bytes_for_a_float_parameter_are_refused_naming_the_key(tmp_path):
    path = handmade(tmp_path / "w.safetensors", {W: tensor("I32", [64], 0, 256)}, 256)
    source = dense_source(path, {W: SHAPE}, {})
    with pytest.raises(CheckpointError, match=rf"{path}: {W} is stored as torch.int32, but the model's parameter is "
                                              "floating point"):
        source(W, SHAPE)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               num_hidden_layers=1, intermediate_size=128, vocab_size=256))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state[W] = torch.ones(SHAPE, dtype=torch.int32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{W} is stored as torch.int32, but the model's parameter is floating"):
        load_dense_into(model, tmp_path / "model.safetensors")


def test_a_lower_precision_file_still_loads(tmp_path):
    """Weights shipped in bf16 load into an fp32 model: only the kind (float) must match, not the precision."""
    path = tmp_path / "w.safetensors"
    save_file({W: torch.full(SHAPE, 0.5, dtype=torch.bfloat16)}, str(path))
    assert torch.equal(dense_source(path, {W: SHAPE}, {})(W, SHAPE).float(), torch.full(SHAPE, 0.5))


@pytest.mark.parametrize("index, message", [
    ([{"weight_map": {}}], r"holds an array, not a JSON object"),
    ({"metadata": {}}, r"weight_map is missing"),
    ({"weight_map": [W]}, r"weight_map \(an array\): Input should be a valid dictionary"),
    ({"weight_map": {W: 5}}, rf"weight_map.{W}=5: Input should be a valid string"),
])
def test_a_bad_index_is_one_line(tmp_path, index, message):
    save_file({W: torch.zeros(SHAPE)}, str(tmp_path / "shard.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    pattern = rf"checkpoint.load_dense={tmp_path / 'model.safetensors.index.json'}.*{message}.*save_pretrained"
    with pytest.raises(CheckpointError, match=pattern):
        dense_source(tmp_path, {W: SHAPE}, {})
    with pytest.raises(CheckpointError, match=pattern):
        read_dense_state_dict(tmp_path)


def test_an_index_naming_a_key_its_shard_lacks_is_one_line(tmp_path):
    save_file({"other": torch.zeros(SHAPE)}, str(tmp_path / "shard.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {W: "shard.safetensors"}}))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'shard.safetensors'} has no {W}, which the folder's "
                                              "index names it for"):
        dense_source(tmp_path, {W: SHAPE}, {})


def test_a_tied_weight_read_under_two_names_gets_memory_of_its_own(tmp_path):
    """The library's default `mmap` backend would hand both names views of the same bytes: two Parameters on one
    storage, updated twice per step. The `pread` backend gives every read memory of its own."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    save_file({embed: torch.ones(4, 8)}, str(tmp_path / "model.safetensors"))
    source = dense_source(tmp_path / "model.safetensors", {embed: (4, 8), head: (4, 8)}, {head: embed})
    first, second = source(embed, (4, 8)), source(head, (4, 8))
    first.add_(1)
    assert torch.equal(second, torch.ones(4, 8)) and first.untyped_storage().data_ptr() != \
        second.untyped_storage().data_ptr()
