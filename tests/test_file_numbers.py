"""Numbers and names from files are checked where they enter (issue 46, Why 8 and 9): LoRA ranks, scales and values,
key types, a SHA256SUMS name, JSON nesting and a seed; each is one line naming the file, never a traceback or a
non-finite loss at step 1."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from checkpoint.adapters import CONFIG, PEFT_PREFIX, WEIGHTS, read_lora_init
from checkpoint.checksums import SUMS, checksum_problem
from checkpoint.dense import CheckpointError, read_dense_state_dict

LINEAR = "model.layers.0.self_attn.q_proj"
DEEP = "[" * 100_000 + "]" * 100_000


def peft_folder(path, r=4, alpha=8.0, a=None, b=None):
    path.mkdir(exist_ok=True)
    a = torch.ones(4, 8) if a is None else a
    b = torch.ones(8, 4) if b is None else b
    save_file({f"{PEFT_PREFIX}{LINEAR}.lora_A.weight": a, f"{PEFT_PREFIX}{LINEAR}.lora_B.weight": b},
              str(path / WEIGHTS))
    (path / CONFIG).write_text(json.dumps({"r": r, "lora_alpha": alpha}))  # json writes inf as Infinity
    return path


@pytest.mark.parametrize("r, alpha, expected", [
    (math.inf, 8.0, "r=inf"), (4, math.inf, "lora_alpha=inf"), (1e-300, 8.0, "r=1e-300"), (4, 0, "lora_alpha=0"),
    (4, math.nan, "lora_alpha=nan"), (True, 8.0, "r=True")])
def test_peft_rank_and_alpha_are_finite_and_positive(tmp_path, r, alpha, expected):
    folder = peft_folder(tmp_path / "peft", r, alpha)
    with pytest.raises(CheckpointError, match=rf"lora.init={folder}: {CONFIG} needs r a positive integer .*{expected}"):
        read_lora_init(folder, 4, 2.0)


@pytest.mark.parametrize("side, value", [("A", math.nan), ("B", math.inf)])
def test_non_finite_adapters_are_named(tmp_path, side, value):
    a, b = torch.ones(4, 8), torch.ones(8, 4)
    (a if side == "A" else b)[0, 0] = value
    folder = peft_folder(tmp_path / "peft", a=a, b=b)
    with pytest.raises(CheckpointError, match=rf"lora.init={folder}: {LINEAR}'s {side} holds NaN or Inf"):
        read_lora_init(folder, 4, 2.0)
    pth = tmp_path / "lora.pth"
    torch.save({f"{LINEAR}.lora.A.weight": a, f"{LINEAR}.lora.B.weight": b}, pth)
    with pytest.raises(CheckpointError, match=rf"{LINEAR}'s {side} holds NaN or Inf"):
        read_lora_init(pth, 4, 2.0)


def test_integer_keys_are_refused_in_one_line(tmp_path):
    pth = tmp_path / "ints.pth"
    torch.save({0: torch.ones(2), 1: torch.ones(2)}, pth)
    with pytest.raises(CheckpointError, match=r"not a state_dict of tensors under string names \(a key is int 0"):
        read_lora_init(pth, 4, 2.0)
    with pytest.raises(CheckpointError, match="not a state_dict of tensors under string names"):
        read_dense_state_dict(pth)


def test_a_sums_name_with_a_nul_byte_is_one_line(tmp_path):
    (tmp_path / SUMS).write_text(f"{'0' * 64}  bad\0name\n")
    problem = checksum_problem(tmp_path)
    assert "holds a NUL byte" in problem and len(problem.splitlines()) == 1


def test_deeply_nested_json_is_one_line(tmp_path):
    from checkpoint.manager import read_meta
    from models import ModelError, model_config

    (tmp_path / "meta.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match=r"unreadable meta.json \(RecursionError\)"):
        read_meta(tmp_path)
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(ModelError, match=r"config.json is not readable JSON \(RecursionError\)"):
        model_config({"hf_config": str(tmp_path)})
    folder = peft_folder(tmp_path / "peft")
    (folder / CONFIG).write_text(DEEP)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_lora_init(folder, 4, 2.0)


def test_a_seed_beyond_32_bits_is_one_line(capsys):
    from tests.test_bad_inputs import run_preflight

    code, lines = run_preflight(["model=tiny", f"train.seed={2**70}"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f"train.seed={2**70} must be between 0 and {2**32 - 1}" in lines[0]


def test_counters_past_what_int64_token_counts_hold_are_refused(tmp_path):
    from checkpoint.meta_schema import checked_meta

    meta = {"format": 1, "step": 2, "data": {"samples_consumed": 2**62, "num_samples": 100, "seed": 0}, "model": {}}
    with pytest.raises(CheckpointError, match=r"data.samples_consumed=4611686018427387904: Input should be less"):
        checked_meta(meta, tmp_path)
    meta["data"]["samples_consumed"] = 2**40
    assert checked_meta(meta, tmp_path) is meta
