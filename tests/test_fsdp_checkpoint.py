"""Checkpoints of sharded data parallelism (parallel.zero=3, FSDP2): the same DCP keys as whole parameters, so a run
saved at zero=3 resumes at zero=3 bit for bit, and loads into zero=1, one process (zero=0), dp4 and TP x PP layouts
and back (zero=1, one process, dp4 and TP x PP checkpoints into zero=3) with every parameter and AdamW moment equal
bit for bit to what was saved (issue 49, acceptance 2).

The two-process jobs run on the suite's pool (tests/spawn.py); the four-process one in fresh processes (see `saved`)."""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from parallel.grid import ParallelGrid
from tests.equivalence import assert_bitwise_resume, compose_run_config, dense_params, run_training
from tests.shared import once_per_session
from tests.spawn import run_workers

pytestmark = pytest.mark.timeout(1800)

COMMON = ["model=tiny", "train.steps=4", "checkpoint.every=2"]
ZERO3 = ["parallel.dp=2", "parallel.zero=3", "schedule.n_microbatches=2"]
ZERO1 = ["parallel.dp=2", "parallel.zero=1", "schedule.n_microbatches=2"]
ONE = ["schedule.n_microbatches=4"]  # the same global batch of 4 sequences
DP4 = ["parallel.dp=4", "parallel.zero=3", "schedule.n_microbatches=1"]
TP2_PP2 = ["parallel.tp=2", "parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=4"]
DP2_TP2 = ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3", "schedule.n_microbatches=2"]  # shards of TP blocks
BACK = ["dp4", "tp2pp2", "dp2tp2", "one"]  # the layouts resumed from zero=3, whose step-4 checkpoints go back to it


def _build(layout: list[str], root: Path, name: str, resume: str | None, step: int = 2):
    at = [f"checkpoint.resume={root / resume / f'checkpoints/step_{step:08d}'}"] if resume else []
    cfg = compose_run_config([*COMMON, *layout, *at], root / "cache")
    p = cfg.parallel
    grid = ParallelGrid.build(p.dp, p.tp, p.pp, backend="gloo", timeout_s=120) if p.dp or p.tp > 1 or p.pp > 1 \
        else ParallelGrid.single(torch.device("cpu"))
    return cfg, grid


def loaded(layout: list[str], root: Path, name: str, resume: str, step: int = 2) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state this rank holds right after loading `resume`'s checkpoint of `step`, whole
    (FSDP shards gathered), by dense name (`name` or `name/field`); TP blocks keyed by their TP rank too."""
    from training.trainer import Trainer

    cfg, grid = _build(layout, root, name, resume, step)
    trainer = Trainer(cfg, grid, root / name)
    trainer.checkpoints.resume()
    state = getattr(trainer.optimizer, "optim", trainer.optimizer).state
    out = {}
    for key, param in trainer.engine.named_parameters().items():
        where = f"{key}@tp{grid.tp_rank}" if getattr(param, "tensor_parallel", False) and grid.tp > 1 else key
        out[where] = _whole(param.detach())
        for field, value in state.get(param, {}).items():
            out[f"{where}/{field}"] = _whole(value)
    return out


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).clone()


def two_worker(rank: int, world_size: int, root: str) -> dict:
    """The zero=3 and zero=1 runs saving at step 2, their resumes across zero levels, and the loaded states."""
    root, runs = Path(root), {}
    for name, layout, resume in (("zero3", ZERO3, None), ("zero3-resumed", ZERO3, "zero3"), ("zero1", ZERO1, None),
                                 ("zero1-from-zero3", ZERO1, "zero3"), ("zero3-from-zero1", ZERO3, "zero1")):
        cfg, grid = _build(layout, root, name, resume)
        runs[name] = run_training(cfg, grid, root / name)
    runs["loaded-zero3"] = loaded(ZERO3, root, "loaded-zero3", "zero3")
    runs["loaded-zero1"] = loaded(ZERO1, root, "loaded-zero1", "zero3")
    runs["loaded-zero3-from-zero1"] = loaded(ZERO3, root, "loaded-zero3-from-zero1", "zero1")
    return runs


def four_worker(rank: int, world_size: int, root: str) -> dict:
    """zero=3's checkpoint loaded at dp4 (zero=3), tp2 x pp2 and dp2 x tp2 (zero=3), and those runs' steps 3-4."""
    root, runs = Path(root), {}
    for name, layout in (("dp4", DP4), ("tp2pp2", TP2_PP2), ("dp2tp2", DP2_TP2)):
        cfg, grid = _build(layout, root, f"{name}-from-zero3", "zero3")
        runs[name] = run_training(cfg, grid, root / f"{name}-from-zero3")
        runs[f"loaded-{name}"] = loaded(layout, root, f"loaded-{name}", "zero3")
    return runs


def back_worker(rank: int, world_size: int, root: str) -> dict:
    """The step-4 checkpoints of the layouts resumed from zero=3, loaded back at dp2 zero=3."""
    return {f"back-{name}": loaded(ZERO3, Path(root), f"back-{name}", f"{name}-from-zero3", step=4) for name in BACK}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The two-process runs (by name, then rank), the four-process ones and one process's loaded state."""
    def compute(root: Path):
        two = run_workers(two_worker, 2, str(root), timeout=420)
        # Fresh processes: in a pooled one after an earlier job's dp2 x tp2 FSDP, DTensor's caches (which compare
        # meshes by value) hand this job's shards meshes naming that job's destroyed DP groups.
        four = run_workers(four_worker, 4, str(root), timeout=420, fresh=True)
        single = loaded(ONE, root, "loaded-one", "zero3")
        one = run_training(_build(ONE, root, "one-from-zero3", "zero3")[0], ParallelGrid.single(torch.device("cpu")),
                           root / "one-from-zero3")
        back = run_workers(back_worker, 2, str(root), timeout=420)
        whole = {f"whole-{name}": [loaded(ONE, root, f"whole-{name}", f"{name}-from-zero3", step=4)] for name in BACK}
        return {k: [r[k] for r in two] for k in two[0]} | {k: [r[k] for r in four] for k in four[0]} | {
            "loaded-one": [single], "one": [one]} | {k: [r[k] for r in back] for k in back[0]} | whole

    return once_per_session(tmp_path_factory, "fsdp-checkpoint", compute)


def test_zero3_resumes_bit_for_bit(saved):
    assert_bitwise_resume(saved["zero3"], saved["zero3-resumed"], start=2)


@pytest.mark.parametrize("layout", ["loaded-zero1", "loaded-one", "loaded-dp4", "loaded-tp2pp2", "loaded-dp2tp2",
                                    "loaded-zero3"])
def test_zero3_checkpoint_loads_bit_for_bit_in_another_layout(saved, layout):
    """Each parameter and AdamW moment, as loaded, equals one process's load of the same checkpoint, bit for bit (TP
    blocks against their rows of it)."""
    whole = saved["loaded-one"][0]
    checked = 0
    for rank in saved[layout]:
        for key, tensor in rank.items():
            name, _, tp = key.partition("@tp")
            name, _, field = name.partition("/") if not tp else (name, "", tp.partition("/")[2])
            name = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # the tied head's copy
            reference = whole[f"{name}/{field}" if field else name]
            if tp and reference.shape != tensor.shape:  # this TP rank's block (AdamW's step count is whole)
                dim = next(d for d, (a, b) in enumerate(zip(reference.shape, tensor.shape)) if a != b)
                reference = reference.chunk(2, dim=dim)[int(tp.partition("/")[0])]
            assert torch.equal(tensor, reference), f"{layout}: {key} differs from what was saved"
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("name", BACK)
def test_a_checkpoint_of_another_layout_loads_back_at_zero3_bit_for_bit(saved, name):
    """zero=3 -> {dp4, tp2 x pp2, dp2 x tp2, one process} -> zero=3: the step-4 checkpoint each of them wrote, loaded at
    dp2 zero=3, holds on every rank what one process loads from it, every parameter and AdamW moment bit for bit."""
    whole = saved[f"whole-{name}"][0]
    for rank in saved[f"back-{name}"]:
        assert rank.keys() == whole.keys()
        assert not [k for k in whole if not torch.equal(rank[k], whole[k])], name
    assert any("/exp_avg" in k for k in whole)


def test_zero1_checkpoint_loads_bit_for_bit_at_zero3(saved):
    mine, want = saved["loaded-zero3-from-zero1"][0], saved["loaded-zero3-from-zero1"][1]
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in mine)
    assert any("/exp_avg" in k for k in mine)


@pytest.mark.parametrize("run,straight", [("zero1-from-zero3", "zero3"), ("zero3-from-zero1", "zero1"),
                                          ("one", "zero3"), ("dp4", "zero3"), ("tp2pp2", "zero3"),
                                          ("dp2tp2", "zero3")])
def test_resumed_in_another_layout_trains_on(saved, run, straight):
    """Steps 3-4 after the resume equal the straight run's (loss rel 1e-5, parameters rel 1e-4: another layout sums
    in another order)."""
    for tail in saved[run]:
        torch.testing.assert_close(torch.tensor(tail["losses"], dtype=torch.float64),
                                   torch.tensor(saved[straight][0]["losses"][2:], dtype=torch.float64), rtol=1e-5,
                                   atol=0)
    expected, got = dense_params(saved[straight]), dense_params(saved[run])
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert ((got[name] - tensor).norm() / tensor.norm()).item() <= 1e-4, name
