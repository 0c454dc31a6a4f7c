"""Training checkpoints: exact resume, resharding to other layouts and to one process, atomic saves."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.manager import COMPLETE, complete_checkpoints
from parallel.grid import ParallelGrid
from tests.conftest import ROOT
from tests.equivalence import compose_run_config, dense_params, run_training
from tests.spawn import run_workers

# 8 layers so that pp4 x vpp2 has a layer per stage; every layout runs 8 steps (one LR schedule).
COMMON = ["model=tiny", "model.num_hidden_layers=8", "train.steps=8", "checkpoint.every=4"]
TP2_PP2 = ["parallel.tp=2", "parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=4"]
DP2_PP2 = ["parallel.dp=2", "parallel.pp=2", "schedule=zb-h1", "schedule.n_microbatches=2"]
PP4_VPP2 = ["parallel.pp=4", "parallel.vpp=2", "schedule=interleaved-1f1b", "schedule.n_microbatches=4"]
DP2_TP2 = ["parallel.dp=2", "parallel.tp=2", "schedule.n_microbatches=2"]  # the same global batch of 8
ONE = ["schedule.n_microbatches=4"]
STEP4 = "checkpoints/step_00000004"
# (run name, layout, run whose step-4 checkpoint it resumes or None)
RUNS = [("tp2pp2", TP2_PP2, None), ("tp2pp2-resumed", TP2_PP2, "tp2pp2"), ("pp4vpp2-from-tp2pp2", PP4_VPP2, "tp2pp2"),
        ("dp2tp2-from-tp2pp2", DP2_TP2, "tp2pp2"), ("dp2pp2", DP2_PP2, None), ("dp2pp2-resumed", DP2_PP2, "dp2pp2")]


def overrides(layout: list[str], root: Path, resume_from: str | None) -> list[str]:
    return [*COMMON, *layout, *([f"checkpoint.resume={root / resume_from / STEP4}"] if resume_from else [])]


def runs_worker(rank: int, world_size: int, runs: list, cache_dir: str, root: str) -> list[dict]:
    """Every run of RUNS in turn on one process group of four."""
    results = []
    for name, layout, resume_from in runs:
        cfg = compose_run_config(overrides(layout, Path(root), resume_from), Path(cache_dir))
        p = cfg.parallel
        grid = ParallelGrid.build(p.dp, p.tp, p.pp, backend="gloo", timeout_s=120)
        results.append(run_training(cfg, grid, Path(root) / name))
    return results


def one_process(layout: list[str], root: Path, name: str, resume_from: str | None = None) -> dict:
    cfg = compose_run_config(overrides(layout, root, resume_from), root / "cache")
    return run_training(cfg, ParallelGrid.single(torch.device("cpu")), root / name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """All four-process runs (one spawn), keyed by run name; each value is the list of per-rank results."""
    root = tmp_path_factory.mktemp("ckpt")
    results = run_workers(runs_worker, 4, RUNS, str(root / "cache"), str(root), timeout=420)
    by_run = {name: [rank[i] for rank in results] for i, (name, _, _) in enumerate(RUNS)}
    return root, by_run


def assert_bitwise_resume(straight: list[dict], resumed: list[dict]) -> None:
    for full, tail in zip(straight, resumed):
        assert tail["losses"] == full["losses"][4:]
        assert full["params"].keys() == tail["params"].keys()
        for name, (tensor, *_) in full["params"].items():
            assert torch.equal(tensor, tail["params"][name][0]), name


def assert_close_resume(straight: list[dict], resumed: list[dict]) -> None:
    for tail in resumed:
        torch.testing.assert_close(torch.tensor(tail["losses"], dtype=torch.float64),
                                   torch.tensor(straight[0]["losses"][4:], dtype=torch.float64), rtol=1e-5, atol=0)
    expected, got = dense_params(straight), dense_params(resumed)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert ((got[name] - tensor).norm() / tensor.norm()).item() <= 1e-4, name


def test_exact_resume_tp2_pp2_1f1b(trained):
    _, runs = trained
    assert len(runs["tp2pp2-resumed"][0]["losses"]) == 4
    assert_bitwise_resume(runs["tp2pp2"], runs["tp2pp2-resumed"])


def test_exact_resume_dp2_pp2_zb_h1(trained):
    _, runs = trained
    assert_bitwise_resume(runs["dp2pp2"], runs["dp2pp2-resumed"])


def test_exact_resume_one_process(tmp_path):
    straight = one_process(ONE, tmp_path, "straight")
    resumed = one_process(ONE, tmp_path, "resumed", resume_from="straight")
    assert_bitwise_resume([straight], [resumed])


@pytest.mark.parametrize("run", ["pp4vpp2-from-tp2pp2", "dp2tp2-from-tp2pp2"])
def test_reshard_to_another_layout(trained, run):
    _, runs = trained
    assert_close_resume(runs["tp2pp2"], runs[run])


def test_reshard_to_one_process(trained):
    root, runs = trained
    resumed = one_process(ONE, root, "one-from-tp2pp2", resume_from="tp2pp2")
    assert_close_resume(runs["tp2pp2"], [resumed])


def test_reshard_to_an_emulated_pipeline(trained):
    # One process plays both pipeline ranks: the tied embedding is two Parameters here, both restored.
    root, runs = trained
    resumed = one_process(["parallel.pp=2", "parallel.emulate=true", "schedule=1f1b", "schedule.n_microbatches=4"],
                          root, "emulated-pp2-from-tp2pp2", resume_from="tp2pp2")
    assert torch.equal(resumed["params"]["model.embed_tokens.weight"][0], resumed["params"]["lm_head.weight"][0])
    assert_close_resume(runs["tp2pp2"], [resumed])


def test_checkpoint_folders_are_complete_and_tied_embedding_stored_once(trained):
    root, _ = trained
    folders = complete_checkpoints(root / "tp2pp2" / "checkpoints")
    assert [f.name for f in folders] == ["step_00000004", "step_00000008"]
    from checkpoint.distributed import read_keys

    keys = read_keys(folders[-1])
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert tuple(keys["model.layers.0.mlp.up_proj.weight"]) == (256, 64)  # the global shape, not a TP shard
    assert "optim/model.layers.7.self_attn.o_proj.weight/exp_avg_sq" in keys
    assert all((f / COMPLETE).is_file() and (f / "tokenizer" / "tokenizer.json").is_file() for f in folders)


KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
import checkpoint.manager as manager
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training

saves = []
real = manager.mark_complete
def mark_complete(folder):  # the second save dies after DCP wrote every file, before its marker
    saves.append(folder)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(folder)
manager.mark_complete = mark_complete
cfg = compose_run_config(["model=tiny", "train.steps=3", "checkpoint.every=1", "schedule.n_microbatches=1"],
                         Path({cache!r}))
run_training(cfg, ParallelGrid.single("cpu"), Path({run!r}))
"""


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    script = KILL_SCRIPT.format(root=str(ROOT), cache=str(tmp_path / "cache"), run=str(run))
    killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    partial = run / "checkpoints" / ".step_00000002.tmp"
    assert (partial / ".metadata").is_file() and not (partial / COMPLETE).exists()  # a full DCP folder, unmarked
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000001"]
    cfg = compose_run_config(["model=tiny", "train.steps=3", "checkpoint.every=1", "schedule.n_microbatches=1",
                              "checkpoint.resume=auto", "checkpoint.keep_last=2"], tmp_path / "cache")
    losses = run_training(cfg, ParallelGrid.single("cpu"), run)["losses"]
    assert len(losses) == 2  # steps 2 and 3: resumed after step 1
    assert f"resumed from {run / 'checkpoints' / 'step_00000001'} (step 1)" in capsys.readouterr().out
    assert not partial.exists()
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000003"]


def test_auto_without_checkpoints_starts_fresh(tmp_path, capsys):
    cfg = compose_run_config(["model=tiny", "train.steps=1", "schedule.n_microbatches=1", "checkpoint.resume=auto",
                              "checkpoint.keep_last=1", "checkpoint.save_final=false"], tmp_path / "cache")
    assert len(run_training(cfg, ParallelGrid.single("cpu"), tmp_path / "run")["losses"]) == 1
    assert "no complete checkpoint in" in capsys.readouterr().out
    assert not (tmp_path / "run" / "checkpoints").exists()  # save_final=false, every=0: nothing written


LOAD_ELSEWHERE = """
import importlib.util, sys, torch
assert importlib.util.find_spec("minimind") is None and importlib.util.find_spec("checkpoint") is None
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.arange(3, 19).view(1, 16)
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
print(model.generate(ids[:, :4], max_new_tokens=3, do_sample=False).shape)
"""


def test_export_loads_without_the_repository(trained, tmp_path):
    root, runs = trained
    from minimind import MiniMindForCausalLM
    from training.config import model_config

    cfg = compose_run_config(COMMON, root / "cache")
    model = MiniMindForCausalLM(model_config(cfg)).eval()
    dense = dense_params(runs["tp2pp2"])
    model.load_state_dict({**dense, "lm_head.weight": dense["model.embed_tokens.weight"]}, strict=True)
    with torch.no_grad():
        expected = model(input_ids=torch.arange(3, 19).view(1, 16)).logits

    for args in ([str(tmp_path / "hf")], [str(tmp_path / "pth"), "--format", "pth"]):
        export = subprocess.run([sys.executable, "scripts/export_hf.py", str(root / "tp2pp2"), *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert export.returncode == 0, export.stderr[-2000:]
    written = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.py", "model.py", "model.safetensors", "tokenizer.json"} <= written

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HOME": str(tmp_path / "hf-home")}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    loaded = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, str(tmp_path / "hf"), str(tmp_path / "logits.pt")],
                            cwd=outside, env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "torch.Size([1, 7])" in loaded.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)

    generate = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), str(tmp_path / "hf"), "the cat",
                               "--max-new-tokens", "4"], cwd=outside, env=env, capture_output=True, text=True,
                              timeout=300)
    assert generate.returncode == 0, generate.stderr[-2000:]

    fresh = MiniMindForCausalLM(model_config(cfg)).eval()
    fresh.load_state_dict(torch.load(tmp_path / "pth" / "pretrain_64.pth", weights_only=True), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=torch.arange(3, 19).view(1, 16)).logits, expected, rtol=0, atol=0)


def test_train_py_saves_then_resumes_auto(tmp_path):
    # The user's path: the same run directory again with checkpoint.resume=auto continues where it stopped.
    args = [sys.executable, "train.py", "model=tiny", "train.seq_len=32", "train.micro_batch_size=2",
            "schedule.n_microbatches=1", "data.num_docs=300", "logger=none", "train.log_every=1",
            f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}", "checkpoint.every=2",
            "checkpoint.resume=auto"]
    first = subprocess.run([*args, "train.steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "no complete checkpoint in" in first.stdout
    assert f"saved checkpoint step 2 to {tmp_path / 'run' / 'checkpoints' / 'step_00000002'} in " in first.stdout
    second = subprocess.run([*args, "train.steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "(step 2)" in second.stdout and "saved checkpoint step 3" in second.stdout
    steps = [line.split('"step": ')[1].split(",")[0] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert steps == ["1", "2", "3"]
