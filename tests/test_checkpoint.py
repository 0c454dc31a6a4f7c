"""Training checkpoints: exact resume, resharding to other layouts and to one process, atomic saves."""

import importlib.util
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
from tests.equivalence import assert_bitwise_resume, compose_run_config, dense_params, run_training
from tests.shared import once_per_session
from tests.spawn import run_workers

# The module's shared runs are set up inside its first test: under load that can take minutes, so the
# per-test bound is the whole module's, not pytest.ini's 600 s for one test.
pytestmark = pytest.mark.timeout(1800)

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
# Exact resume of what keeps more state than weights: ZeRO-1's sharded AdamW, MoE routers, bf16 autocast, the V
# placement (a tied embedding that is one Parameter on rank 0), dropout (every rank's RNG; TP ranks must agree) and
# an untied head. Each runs 4 steps on two processes, saves at 2 and is resumed from there in the same layout. Bit for
# bit in bf16 too: the resumed run runs the same kernels on the same numbers in the same order, so every bf16 cast
# rounds as the straight run's did (no tolerance, hence none derived from bf16).
EXACT_COMMON = ["model=tiny", "train.steps=4", "checkpoint.every=2"]
EXACT = {"zero1": ["parallel.zero=1", "parallel.dp=2", "schedule.n_microbatches=2"],
         "moe": ["model=tiny-moe", "parallel.tp=2", "schedule.n_microbatches=4"],
         "bf16": ["train.dtype=bf16", "parallel.dp=2", "schedule.n_microbatches=2"],
         "zbv": ["parallel.pp=2", "parallel.vpp=2", "schedule=zbv", "schedule.n_microbatches=4"],
         "dropout": ["model.dropout=0.1", "parallel.tp=2", "schedule.n_microbatches=4"],
         "untied": ["model.tie_word_embeddings=false", "parallel.pp=2", "schedule.n_microbatches=4"]}
STEP2 = "checkpoints/step_00000002"


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


def exact_worker(rank: int, world_size: int, root: str) -> list[dict]:
    """Each EXACT layout, then its resume from step 2, on one process group of two."""
    results = []
    for name, layout in EXACT.items():
        for run, extra in ((name, []), (f"{name}-resumed", [f"checkpoint.resume={Path(root) / name / STEP2}"])):
            cfg = compose_run_config([*EXACT_COMMON, *layout, *extra], Path(root) / "cache")
            grid = ParallelGrid.build(None, cfg.parallel.tp, 1 if cfg.parallel.emulate else cfg.parallel.pp,
                                      backend="gloo", timeout_s=120)
            results.append((run, run_training(cfg, grid, Path(root) / run)))
    return results


@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> tuple[Path, dict]:
    """The EXACT runs and their resumes (one job on the two-process pool), by run name then rank."""
    def compute(root: Path) -> tuple[Path, dict]:
        by_rank = run_workers(exact_worker, 2, str(root), timeout=420)
        return root, {name: [rank[i][1] for rank in by_rank] for i, (name, _) in enumerate(by_rank[0])}

    return once_per_session(tmp_path_factory, "checkpoint-exact", compute)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """All four-process runs (one spawn), keyed by run name; each value is the list of per-rank results."""
    def compute(root: Path) -> tuple[Path, dict]:
        results = run_workers(runs_worker, 4, RUNS, str(root / "cache"), str(root), timeout=420)
        return root, {name: [rank[i] for rank in results] for i, (name, _, _) in enumerate(RUNS)}

    return once_per_session(tmp_path_factory, "checkpoint-trained", compute)


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
    assert_bitwise_resume(runs["tp2pp2"], runs["tp2pp2-resumed"], start=4)


def test_exact_resume_dp2_pp2_zb_h1(trained):
    _, runs = trained
    assert_bitwise_resume(runs["dp2pp2"], runs["dp2pp2-resumed"], start=4)


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_resume_of_optimizer_shards_routers_bf16_v_placement_and_dropout(exact, name):
    """Losses, the data read, every rank's RNG state after each step and the final parameters, bit for bit."""
    _, runs = exact
    assert_bitwise_resume(runs[name], runs[f"{name}-resumed"], start=2)
    if name == "dropout":  # the RNG really is drawn, and TP ranks draw the same masks for replicated activations
        assert len(set(runs[name][0]["rng"])) == 4
        by_coords = {r["coords"]: r for r in runs[name]}
        for (pp, dp, tp), result in by_coords.items():
            assert result["rng"] == by_coords[pp, dp, 0]["rng"], (pp, dp, tp)
            for param, (tensor, dim, *_) in result["params"].items():
                if dim is None:  # replicated over TP: bitwise one value
                    assert torch.equal(tensor, by_coords[pp, dp, 0]["params"][param][0]), param


def test_exact_resume_one_process(tmp_path):
    straight = one_process(ONE, tmp_path, "straight")
    resumed = one_process(ONE, tmp_path, "resumed", resume_from="straight")
    assert_bitwise_resume([straight], [resumed], start=4)


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


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path, caplog):
    caplog.set_level("INFO", logger="sluice")
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
    assert f"resumed from {run / 'checkpoints' / 'step_00000001'} (step 1)" in caplog.text
    assert not partial.exists()
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000003"]


INTERRUPTED = ["model=tiny", "train.steps=3", "checkpoint.every=1", "parallel.dp=2", "schedule.n_microbatches=2",
               "parallel.timeout_s=60"]


def _dies_in_second_save_worker(rank: int, world_size: int, root: str) -> None:
    """Rank 1 is killed inside the DCP write of the step-2 checkpoint; rank 0 is left in the collective."""
    from checkpoint import distributed

    if rank == 1:
        real, calls = distributed.dcp.save, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        distributed.dcp.save = dying
    cfg = compose_run_config(INTERRUPTED, Path(root) / "cache")
    run_training(cfg, ParallelGrid.build(2, 1, 1, backend="gloo", timeout_s=60), Path(root) / "run")


def _resume_worker(rank: int, world_size: int, root: str, name: str, extra: list[str]) -> dict:
    cfg = compose_run_config([*INTERRUPTED, *extra], Path(root) / "cache")
    return run_training(cfg, ParallelGrid.build(2, 1, 1, backend="gloo", timeout_s=60), Path(root) / name)


def test_a_save_interrupted_on_one_rank_leaves_the_previous_checkpoint_to_resume(tmp_path):
    with pytest.raises(RuntimeError, match=r"rank 0 failed|ranks exited without reporting"):
        run_workers(_dies_in_second_save_worker, 2, str(tmp_path), timeout=120, fresh=True)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["step_00000001"]
    straight = run_workers(_resume_worker, 2, str(tmp_path), "straight", [], timeout=120)
    resumed = run_workers(_resume_worker, 2, str(tmp_path), "run", ["checkpoint.resume=auto"], timeout=120)
    assert_bitwise_resume(straight, resumed, start=1)  # steps 2 and 3 again, from step 1's checkpoint


def test_auto_without_checkpoints_starts_fresh(tmp_path, caplog):
    caplog.set_level("INFO", logger="sluice")
    cfg = compose_run_config(["model=tiny", "train.steps=1", "schedule.n_microbatches=1", "checkpoint.resume=auto",
                              "checkpoint.keep_last=1", "checkpoint.save_final=false"], tmp_path / "cache")
    assert len(run_training(cfg, ParallelGrid.single("cpu"), tmp_path / "run")["losses"]) == 1
    assert "no complete checkpoint in" in caplog.text
    assert not (tmp_path / "run" / "checkpoints").exists()  # save_final=false, every=0: nothing written


LOAD_ELSEWHERE = """
import importlib.util, sys, torch
assert importlib.util.find_spec("minimind") is None and importlib.util.find_spec("checkpoint") is None
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=False).eval()  # stock Qwen3
ids = torch.arange(3, 19).view(1, 16)
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
print(model.generate(ids[:, :4], max_new_tokens=3, do_sample=False).shape)

import runpy  # then scripts/generate.py on that folder, in this same process outside the repository
sys.argv = [sys.argv[3], sys.argv[1], "the cat", "--max-new-tokens", "4"]
runpy.run_path(sys.argv[0], run_name="__main__")  # exits with generate.py's code
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

    spec = importlib.util.spec_from_file_location("export_hf_script", ROOT / "scripts" / "export_hf.py")
    export = importlib.util.module_from_spec(spec)  # the script's main(argv) in this process: a start-up fewer
    spec.loader.exec_module(export)
    assert export.main([str(root / "tp2pp2"), str(tmp_path / "hf")]) == 0
    from checkpoint.export import export_checkpoint

    export_checkpoint(root / "tp2pp2", tmp_path / "pth", fmt="pth", pth_dtype=torch.float32)  # --pth-dtype fp32
    written = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"model.safetensors", "tokenizer.json"} <= written and "model.py" not in written  # no custom code

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HOME": str(tmp_path / "hf-home")}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    loaded = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, str(tmp_path / "hf"), str(tmp_path / "logits.pt"),
                             str(ROOT / "scripts" / "generate.py")], cwd=outside, env=env, capture_output=True,
                            text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]  # the stock load, then generate.py
    assert "torch.Size([1, 7])" in loaded.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)

    fresh = MiniMindForCausalLM(model_config(cfg)).eval()
    fresh.load_state_dict(torch.load(tmp_path / "pth" / "pretrain_64.pth", weights_only=True), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=torch.arange(3, 19).view(1, 16)).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["moe", "untied"])
def test_export_of_moe_and_untied_models_gives_the_trained_logits(exact, name, tmp_path):
    """The exported folder (and .pth) of an MoE model and of an untied one hold exactly the trained weights."""
    from checkpoint.export import export_checkpoint
    from minimind import MiniMindForCausalLM

    root, runs = exact
    from transformers import AutoModelForCausalLM

    from checkpoint.manager import read_meta
    from models import config_from_record

    folder = export_checkpoint(root / name, tmp_path / "hf")  # the stock family: Qwen3-MoE, Qwen3 untied
    exported = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tied = exported.config.tie_word_embeddings
    assert tied == (name != "untied")
    assert type(exported).__name__ == ("Qwen3MoeForCausalLM" if name == "moe" else "Qwen3ForCausalLM")
    config = read_meta(complete_checkpoints(root / name / "checkpoints")[-1])["model"]
    trained_model = MiniMindForCausalLM(config_from_record(config)).eval()
    dense = dense_params(runs[name], tied=tied)
    trained_model.load_state_dict({**dense, **({"lm_head.weight": dense["model.embed_tokens.weight"]} if tied else {})})
    ids = torch.arange(3, 35).view(2, 16)
    with torch.no_grad():  # the same weights; a CPU kernel may round differently with another memory alignment
        torch.testing.assert_close(exported(input_ids=ids).logits, trained_model(input_ids=ids).logits, rtol=0,
                                   atol=1e-5)
    pth = export_checkpoint(root / name, tmp_path / "pth", fmt="pth")
    assert set(torch.load(pth, weights_only=True)) == set(trained_model.state_dict())
