"""What the fuzzer feeds and to which reader: mutated files a folder brings (meta.json, config.json, SHA256SUMS,
`.metadata`, safetensors headers, PEFT configs, LoRA .pth files, JSONL rows) and train.py's command-line values,
handed in-process to the function that reads them. Each target returns normally (accepted) or raises one of the
readers' own errors in one line; anything else (a traceback the user would see) fails the property.
tests/test_fuzz.py runs each with a small fixed budget, scripts/fuzz.py for as long as asked."""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from checkpoint.errors import CheckpointError

# Values a crafted file puts where a number, a name or an object belongs.
ODD_NUMBERS = st.sampled_from([0, -1, 1, 2, 2**31, 2**63, 2**70, 10**9, -(2**63), 1e-300, 1e300, math.inf,
                               -math.inf, math.nan, 0.5, True, False])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), ODD_NUMBERS,
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
JSON_VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=6)
NESTING = st.integers(1, 200_000).map(lambda depth: "[" * depth + "]" * depth)


def one_line(error: BaseException) -> None:
    """The error a user sees is one line with something to say."""
    text = str(error)
    assert text.strip() and "\n" not in text.strip(), repr(text)


def mutated(base: dict[str, Any], data: st.DataObject, fields: list[str]) -> Any:
    """`base` with a few fields (known ones or new) set to odd values or removed; sometimes not an object at all."""
    if data.draw(st.integers(0, 19)) == 0:
        return data.draw(JSON_VALUES)
    record = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(fields)).split(".")
        node = record
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            if data.draw(st.integers(0, 5)) == 0:
                node.pop(path[-1], None)
            else:
                node[path[-1]] = data.draw(JSON_VALUES)
    return record


def json_text(value: Any, data: st.DataObject) -> str:
    """`value` as JSON (Infinity and NaN as Python writes them), sometimes cut short or replaced by deep nesting."""
    text = json.dumps(value)
    choice = data.draw(st.integers(0, 9))
    if choice == 0:
        return text[:data.draw(st.integers(0, len(text)))]
    if choice == 1:
        return data.draw(NESTING)
    return text


MODEL = {"model_type": "minimind", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
         "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": True}
META = {"format": 1, "step": 2, "data": {"samples_consumed": 4, "num_samples": 100, "seed": 0}, "model": MODEL,
        "layout": {}, "run_id": "abc123"}
META_FIELDS = ["format", "step", "data.samples_consumed", "data.num_samples", "data.seed", "model", "layout",
               "lora", "run_id", *(f"model.{k}" for k in MODEL), "model.head_dim", "model.intermediate_size",
               "model.rope_scaling", "model.use_moe", "model.num_experts"]
PEFT = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": False,
        "use_dora": False}
LINEAR = "model.layers.0.self_attn.q_proj"


def target_meta(folder: Path, data: st.DataObject) -> None:
    """A checkpoint's meta.json: its schema (resume, export), then its model record's values and size (export)."""
    from checkpoint.export import model_record_config
    from checkpoint.manager import read_meta

    (folder / "meta.json").write_text(json_text(mutated(META, data, META_FIELDS), data))
    try:
        meta = read_meta(folder)
        model_record_config(folder, meta["model"])
    except CheckpointError as error:
        one_line(error)


def target_config(folder: Path, data: st.DataObject) -> None:
    """A model.hf_config folder's config.json (also a teacher's, generate.py's)."""
    from models import ModelError, model_config

    fields = [*MODEL, "head_dim", "intermediate_size", "rope_parameters", "rope_scaling", "layer_types",
              "sliding_window", "num_local_experts", "use_moe"]
    base = {**MODEL, "model_type": data.draw(st.sampled_from(["minimind", "qwen3", "llama"])),
            "intermediate_size": 128, "head_dim": 16}
    (folder / "config.json").write_text(json_text(mutated(base, data, fields), data))
    try:
        model_config({"hf_config": str(folder)})
    except ModelError as error:
        one_line(error)


def target_sums(folder: Path, data: st.DataObject) -> None:
    """A checkpoint's SHA256SUMS: lines of a digest and a name (a NUL, a `..`, an absolute path, a missing file)."""
    from checkpoint.checksums import SUMS, checksum_problem

    (folder / "meta.json").write_text("{}")
    names = st.one_of(st.text(max_size=12), st.sampled_from(["meta.json", "../x", "/etc/passwd", "a\0b", "", "."]))
    digest = st.one_of(st.just("0" * 64), st.text("0123456789abcdef", min_size=60, max_size=66))
    lines = data.draw(st.lists(st.tuples(digest, names), max_size=4))
    (folder / SUMS).write_text("".join(f"{d}  {n}\n" for d, n in lines), encoding="utf-8", errors="surrogateescape")
    try:
        problem = checksum_problem(folder)
    except CheckpointError as error:  # SUMS itself unreadable: raised, as a resume and an export report it
        one_line(error)
    else:
        assert problem is None or "\n" not in problem, problem


def target_metadata(folder: Path, data: st.DataObject) -> None:
    """DCP's `.metadata` pickle, bytes flipped or cut, read through the allow-list."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    from checkpoint.safe_reader import load_metadata

    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 4]),
                                   [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))])
    raw = bytearray(pickle.dumps(Metadata(state_dict_metadata={"w": tensor})))
    for _ in range(data.draw(st.integers(0, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)))]
    (folder / ".metadata").write_bytes(bytes(raw))
    try:
        load_metadata(folder / ".metadata")
    except CheckpointError as error:
        one_line(error)


def target_safetensors(folder: Path, data: st.DataObject) -> None:
    """A safetensors file whose JSON header is mutated (dtypes, shapes, offsets, its declared length)."""
    from checkpoint.safetensors_file import SafetensorsFile

    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    header = mutated({"w": entry, "__metadata__": {"format": "pt"}}, data,
                     ["w.dtype", "w.shape", "w.data_offsets", "w", "__metadata__", "v"])
    text = json_text(header, data).encode("utf-8", errors="surrogateescape")
    length = data.draw(st.one_of(st.just(len(text)), st.integers(0, 2**64 - 1)))
    (folder / "w.safetensors").write_bytes(struct.pack("<Q", length) + text + bytes(16))
    try:
        file = SafetensorsFile(folder / "w.safetensors")
        for key in ("w", "v"):
            try:
                file.read(key)
            except CheckpointError as error:
                one_line(error)
    except CheckpointError as error:
        one_line(error)


def target_peft(folder: Path, data: st.DataObject) -> None:
    """A PEFT adapter folder's adapter_config.json (r, lora_alpha, flags) over valid adapter weights."""
    from safetensors.torch import save_file

    from checkpoint.adapters import CONFIG, PEFT_PREFIX, WEIGHTS, read_lora_init

    save_file({f"{PEFT_PREFIX}{LINEAR}.lora_A.weight": torch.ones(4, 8),
               f"{PEFT_PREFIX}{LINEAR}.lora_B.weight": torch.ones(8, 4)}, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json_text(mutated(PEFT, data, list(PEFT)), data))
    try:
        read_lora_init(folder, 4, 2.0)
    except CheckpointError as error:
        one_line(error)


def target_lora_pth(folder: Path, data: st.DataObject) -> None:
    """MiniMind's LoRA .pth: key types, pairs, shapes and values (NaN, Inf) of a state_dict."""
    from checkpoint.adapters import read_lora_init

    keys = st.one_of(st.sampled_from([f"{LINEAR}.lora.A.weight", f"{LINEAR}.lora.B.weight", "module.x.lora.A.weight"]),
                     st.integers(-3, 3), st.text(max_size=8))
    shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3)
    fill = st.sampled_from([0.0, 1.0, math.nan, math.inf])
    state = {data.draw(keys): torch.full(data.draw(shapes), data.draw(fill))
             for _ in range(data.draw(st.integers(0, 3)))}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (folder / "lora.pth").write_bytes(buffer.getvalue())
    try:
        read_lora_init(folder / "lora.pth", 4, 2.0)
    except CheckpointError as error:
        one_line(error)


def target_jsonl(folder: Path, data: st.DataObject) -> None:
    """One JSONL row for each task: accepted (a payload) or a reason, never an exception."""
    from training.data.jsonl import parse_row
    from training.data.rows import TASKS

    row = mutated({"text": "hi", "conversations": [{"role": "user", "content": "hi"}], "chosen": [],
                   "rejected": []}, data, ["text", "conversations", "chosen", "rejected"])
    line = json_text(row, data).encode("utf-8", errors="surrogateescape")
    for task in TASKS.values():
        parse_row(line, task)


CLI_KEYS = ["train.steps", "train.seed", "train.micro_batch_size", "train.seq_len", "train.grad_clip",
            "model.hidden_size", "model.num_hidden_layers", "model.vocab_size", "model.num_attention_heads",
            "optim.lr", "optim.warmup_steps", "checkpoint.every", "checkpoint.keep_last", "parallel.tp", "parallel.pp",
            "data.seed", "lora.rank", "lora.alpha", "schedule.n_microbatches"]
CLI_VALUES = st.one_of(st.sampled_from(["1e9", "-1", "0", "inf", "nan", "-inf", str(2**70), str(-(2**63)), "abc",
                                        "null", "[1,2]", "{a:1}", "''", "true", "1.5", "10000", "2147483648"]),
                       st.integers(-(2**65), 2**65).map(str))


def target_cli(folder: Path, data: st.DataObject) -> None:
    """A train.py command line with one odd value: the pre-launch check passes, or exits 2 with one `sluice:` line."""
    import contextlib

    from training.launch.cli import preflight

    key, value = data.draw(st.sampled_from(CLI_KEYS)), data.draw(CLI_VALUES)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            preflight(["model=tiny", "logger=none", f"data.cache_dir={folder}", f"{key}={value}"])
        except SystemExit as leave:
            lines = [line for line in err.getvalue().splitlines() if not line.startswith("sluice: config warning")]
            assert leave.code == 2 and len(lines) == 1 and lines[0].startswith("sluice: "), (key, value, lines)


@dataclass(frozen=True)
class Target:
    """A reader under fuzz: a name and the function that feeds it one example in a fresh folder."""

    name: str
    run: Callable[[Path, st.DataObject], None]
    examples: int = 100  # the suite's budget (tests/test_fuzz.py): a few ms an example; less for slow readers


TARGETS = [Target("meta.json", target_meta, examples=40),  # 0.1 s an example: the export's config is built
           Target("config.json", target_config), Target("SHA256SUMS", target_sums),
           Target(".metadata", target_metadata), Target("safetensors", target_safetensors),
           Target("adapter_config.json", target_peft), Target("lora.pth", target_lora_pth),
           Target("jsonl", target_jsonl),
           Target("train.py overrides", target_cli, examples=12)]  # Hydra composes each: 0.2 s an example


def in_fresh_folder(target: Target, data: st.DataObject) -> None:
    """One example of `target`, in a folder of its own that is removed after."""
    with tempfile.TemporaryDirectory() as folder:
        target.run(Path(folder), data)
