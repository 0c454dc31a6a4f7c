"""`lora.init`: a run starts from saved adapters (MiniMind's LoRA .pth or a PEFT folder) instead of lora_A normal /
lora_B zeros. A run's exported adapters start a new run where the first ended (one process and pp2), a file written
from MiniMind's documented key names loads and TP slices it as it slices drawn adapters, and a file that does not fit
the run is one line and exit 2 before launch."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checkpoint.export import read_training_weights
from checkpoint.lora_merge import is_adapter
from parallel.grid import ParallelGrid
from tests.equivalence import EMU, compose_run_config, run_training
from tests.test_bad_inputs import run_preflight
from tests.test_scripts import script
from training.config import register_schema
from training.methods.lora import LoraSpec, apply_lora
from training.trainer import Trainer

CPU = torch.device("cpu")
FIRST = ["model=tiny", "schedule.n_microbatches=2", "optim.lr=0.05", "lora.rank=4", "lora.alpha=8"]  # scale 2
SQUARES = [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "o_proj")]  # tiny: hidden 64


def minimind_lora(path: Path, linears: dict[str, tuple[int, int]], rank: int, seed: int = 0) -> dict:
    """A LoRA .pth in MiniMind's keys (`<linear>.lora.A.weight` [r, in], `<linear>.lora.B.weight` [out, r]) for
    linears given as name -> (in, out); random values, as a trained file holds."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, (in_features, out_features) in linears.items():
        state[f"{name}.lora.A.weight"] = torch.randn(rank, in_features, generator=generator)
        state[f"{name}.lora.B.weight"] = torch.randn(out_features, rank, generator=generator)
    torch.save(state, path)
    return state


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> SimpleNamespace:
    """A 2-step LoRA run's final adapters, exported as MiniMind's .pth, as a PEFT folder and merged (HF folder); and
    the step-1 loss of a plain run from the merged weights: where a run started from the adapters must start."""
    register_schema()
    root = tmp_path_factory.mktemp("first")
    cfg = compose_run_config([*FIRST, "train.steps=2", "checkpoint.save_final=true"], root / "cache")
    run_training(cfg, ParallelGrid.single(CPU), root / "run")
    export = script("export_hf")
    for out, args in (("pth", ["--format", "pth", "--adapters-only"]), ("peft", ["--adapters-only"]), ("merged", [])):
        assert export.main([str(root / "run"), str(root / out), *args]) == 0
    state, _ = read_training_weights(root / "run")
    merged = compose_run_config(["model=tiny", "schedule.n_microbatches=2", "train.steps=1",
                                 f"checkpoint.load_dense={root / 'merged'}"], root / "cache")
    loss = Trainer(merged, ParallelGrid.single(CPU), root / "merged-run").fit()[0]
    return SimpleNamespace(root=root, pth=root / "pth" / "lora_64.pth", peft=root / "peft",
                           adapters={k: v for k, v in state.items() if is_adapter(k)}, merged_loss=loss)


def started(overrides: list[str], cache: Path, run_dir: Path) -> tuple[dict[str, torch.Tensor], float]:
    """A one-step run's adapters as built (before any step) and its step-1 loss."""
    trainer = Trainer(compose_run_config(["train.steps=1", *overrides], cache), ParallelGrid.single(CPU), run_dir)
    adapters = {n: p.detach().clone() for n, p in trainer.engine.named_parameters().items() if is_adapter(n)}
    return adapters, trainer.fit()[0]


@pytest.mark.parametrize("layout", [[], ["parallel.pp=2", "schedule=zb-h1", EMU]], ids=["one-process", "pp2"])
def test_exported_minimind_lora_starts_a_run_where_the_first_ended(first, layout, tmp_path):
    adapters, loss = started([*FIRST, f"lora.init={first.pth}", *layout], first.root / "cache", tmp_path / "run")
    assert sorted(adapters) == sorted(first.adapters) and len(adapters) == 2 * len(SQUARES)
    for name, tensor in adapters.items():  # B went out times the scale 2 and came back divided by it
        torch.testing.assert_close(tensor, first.adapters[name], rtol=1e-6, atol=1e-7, msg=name)
    assert loss == pytest.approx(first.merged_loss, rel=1e-5)  # B A x scale + W x equals the merged W' x


def test_a_peft_folder_starts_a_run_rescaled_to_its_alpha(first, tmp_path):
    """The PEFT folder was written at alpha 8 (scale 2); a run of alpha 4 (scale 1) takes B doubled: the same
    product, so the same step-1 loss."""
    overrides = [*FIRST, "lora.alpha=4", f"lora.init={first.peft}"]
    adapters, loss = started(overrides, first.root / "cache", tmp_path / "run")
    assert sorted(adapters) == sorted(first.adapters)
    for name, tensor in adapters.items():
        want = first.adapters[name] * (2.0 if ".lora_B." in name else 1.0)
        torch.testing.assert_close(tensor, want, rtol=1e-6, atol=1e-7, msg=name)
    assert loss == pytest.approx(first.merged_loss, rel=1e-5)


def test_a_file_in_minimind_keys_loads_and_tp_slices_it(tmp_path):
    """A file written from MiniMind's documented key names (rank 16, scale 1) becomes the adapters; under TP the two
    ranks' blocks join back to the file (q_proj colwise: B's rows split; o_proj rowwise: A's columns split)."""
    from parallel.tensor_pass import shard_modules
    from tests.test_runtime import tiny  # hidden 32, 4 layers: q_proj and o_proj are its square linears

    path = tmp_path / "lora_32.pth"
    state = minimind_lora(path, {n: (32, 32) for n in SQUARES}, rank=16)
    spec = LoraSpec(rank=16, init=str(path))
    whole = apply_lora(tiny(), spec, ParallelGrid.single(CPU)).module.model.layers["1"].self_attn
    torch.testing.assert_close(whole.q_proj.lora_A.weight, state["model.layers.1.self_attn.q_proj.lora.A.weight"])
    torch.testing.assert_close(whole.o_proj.lora_B.weight, state["model.layers.1.self_attn.o_proj.lora.B.weight"])
    ranks = [apply_lora(shard_modules(tiny(), grid), spec, grid).module.model.layers["1"].self_attn
             for grid in (ParallelGrid(tp=2, tp_rank=r) for r in range(2))]
    q_b = torch.cat([attn.q_proj.lora_B.weight for attn in ranks], dim=0)
    o_a = torch.cat([attn.o_proj.lora_A.weight for attn in ranks], dim=1)
    torch.testing.assert_close(q_b, state["model.layers.1.self_attn.q_proj.lora.B.weight"])
    torch.testing.assert_close(o_a, state["model.layers.1.self_attn.o_proj.lora.A.weight"])
    assert all(torch.equal(attn.q_proj.lora_A.weight, whole.q_proj.lora_A.weight) for attn in ranks)


@pytest.fixture
def preflight_lora(tmp_path, capsys, monkeypatch):
    """The pre-launch check of a tiny LoRA run of rank 4 from `lora.init=path`: (exit code, stderr lines)."""
    register_schema()
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def check(path: Path, *extra: str) -> tuple[int, list[str]]:
        return run_preflight(["model=tiny", "lora.rank=4", f"lora.init={path}", *extra,
                              f"hydra.run.dir={tmp_path}/run"], capsys)
    return check


def test_a_fitting_file_passes_the_check(preflight_lora, tmp_path):
    path = tmp_path / "ok.pth"
    minimind_lora(path, {n: (64, 64) for n in SQUARES}, rank=4)
    assert preflight_lora(path) == (0, [])


def bad_file(tmp_path: Path, case: str) -> Path:
    """A lora.init path that does not fit a tiny rank-4 run on its square linears."""
    path = tmp_path / f"{case}.pth"
    squares = {n: (64, 64) for n in SQUARES}
    if case == "fifo":
        os.mkfifo(path)
    elif case == "empty":
        path.touch()
    elif case == "no-pairs":
        torch.save({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, path)
    elif case == "rank-8":
        minimind_lora(path, squares, rank=8)
    elif case == "missing-o_proj":
        minimind_lora(path, {n: s for n, s in squares.items() if "o_proj" not in n}, rank=4)
    elif case in ("k_proj", "layer-9"):
        name = "model.layers.0.self_attn.k_proj" if case == "k_proj" else "model.layers.9.self_attn.q_proj"
        minimind_lora(path, {**squares, name: (64, 32 if case == "k_proj" else 64)}, rank=4)
    elif case == "hidden-32":
        minimind_lora(path, {n: (32, 32) for n in SQUARES}, rank=4)
    elif case == "folder":
        path = tmp_path / "adapters"
        path.mkdir()
    return path


BAD = [("missing", "lora.init={p} does not exist; give a MiniMind LoRA .pth (scripts/export_hf.py RUN OUT "
                   "--adapters-only --format pth writes one) or a PEFT adapter folder"),
       ("fifo", "lora.init={p}: {p} is a FIFO, not a regular file; refusing to open it (replace it with the real "
                "file)"),
       ("empty", "lora.init={p}: the file is empty or cut short; give a file MiniMind's save_lora wrote"),
       ("no-pairs", "lora.init={p}: holds no MiniMind LoRA pairs (<linear>.lora.A.weight and <linear>.lora.B.weight "
                    "for each adapted linear); give a file MiniMind's save_lora wrote"),
       ("rank-8", "lora.init={p}: its adapters have rank 8; set lora.rank=8"),
       ("missing-o_proj", "lora.init={p}: it holds no adapters for model.layers.0.self_attn.o_proj, which "
                          "lora.targets=null (square linears) adapts; set lora.targets to the linears the file adapts "
                          "(those of the run that saved it)"),
       ("k_proj", "lora.init={p}: it holds adapters for model.layers.0.self_attn.k_proj, which lora.targets=null "
                  "(square linears) does not adapt; set lora.targets to the linears the file adapts (those of the run "
                  "that saved it)"),
       ("layer-9", "lora.init={p}: it holds adapters for model.layers.9.self_attn.q_proj, not a linear of this "
                   "model's decoder layers; give adapters trained on this model"),
       ("folder", "lora.init={p}: a folder without adapter_config.json and adapter_model.safetensors; give a PEFT "
                  "adapter folder (scripts/export_hf.py RUN OUT --adapters-only writes one) or a MiniMind LoRA .pth"),
       ("hidden-32", "lora.init={p}: its adapters of model.layers.0.self_attn.o_proj are 32x32 (in x out) but the "
                     "linear is 64x64; give adapters trained on this model")]


@pytest.mark.timeout(120)  # a FIFO opened would block forever
@pytest.mark.parametrize("case, expected", BAD, ids=[case for case, _ in BAD])
def test_a_file_that_does_not_fit_is_one_line_before_launch(preflight_lora, tmp_path, case, expected):
    path = bad_file(tmp_path, case)
    assert preflight_lora(path) == (2, ["sluice: config error: " + expected.format(p=path)])


def test_zero_pairs_stand_for_linears_not_adapted(preflight_lora, tmp_path):
    """MiniMind's padded export writes a zero pair for each square linear a run did not adapt: targeting q_proj only,
    a file whose o_proj pairs are zeros fits, and one whose o_proj pairs are not is refused."""
    path = tmp_path / "q.pth"
    state = minimind_lora(path, {n: (64, 64) for n in SQUARES}, rank=4)
    assert preflight_lora(path, "lora.targets=[q_proj]")[0] == 2
    torch.save({k: torch.zeros_like(v) if "o_proj" in k else v for k, v in state.items()}, path)
    assert preflight_lora(path, "lora.targets=[q_proj]") == (0, [])


def test_lora_init_without_adapters_is_a_warning(tmp_path, capsys):
    register_schema()
    code, lines = run_preflight(["model=tiny", f"lora.init={tmp_path / 'x.pth'}"], capsys)
    assert (code, lines) == (0, [f"sluice: config warning: lora.init={tmp_path / 'x.pth'} is read only when "
                                 "lora.rank>0 (here lora.rank=0); it is ignored"])
