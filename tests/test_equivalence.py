"""Every layout trains with the numbers of one process doing gradient accumulation (tiny models).

Per step: losses, aux losses and grad norms; after step 1: every gradient; at the end: the parameters of
every DP replica. Layouts marked `emu` run with parallel.emulate=true (one process plays every pipeline rank
of its (dp, tp) coordinate: the same stages, lists and runtime loop over in-process channels); the ones with
world > 1 share one spawn per world size. Real P2P pipelines are covered by the distributed layouts above them.
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from parallel.pipeline.lowered import lower_pipeline
from parallel.pipeline.tables import dump_builtin
from tests.equivalence import (EMU, Layout, assert_equivalent, assert_equivalent_bf16, baseline, compose_run_config,
                               layout_worker, layouts_worker, run_training)
from tests.fsdp_layouts import FSDP_LAYOUTS, GATHER_BF16, assert_bf16_gathers, assert_sharded
from tests.shared import once_per_session
from tests.spawn import run_workers
from training.config import model_config
from training.specs import pipeline_spec

# The module's shared runs are set up inside its first test: under load that can take minutes, so the
# per-test bound is the whole module's, not pytest.ini's 600 s for one test.
pytestmark = pytest.mark.timeout(1800)

STEPS = ["train.steps=3", "schedule.n_microbatches=4"]
TABLE = "{table}"  # stands for a CSV dumped from a built-in schedule when the test runs
TINY, MOE = ["model=tiny"], ["model=tiny-moe"]
PADDED = ["model=tiny", "data.format=padded", "train.seq_len=128"]  # one document per sample, most shorter
UNTIED = ["model=tiny", "model.tie_word_embeddings=false"]
BF16 = ["model=tiny", "train.dtype=bf16"]
# bf16 autocast against a bf16 single process, at tolerances derived from bf16 (tests.equivalence.bf16_tolerances:
# 3x the distance of one bf16 process from one fp32 process). Without TP a layout runs the same bf16 kernels on the
# same micro-batches and sums fp32 gradients in another order (DP); TP also rounds each row-parallel matmul's partial
# products to bf16 before the all-reduce. Measured tp2-pp2 against the derived bounds: loss 2.8e-5 (6.3e-5), grad norm
# 1.9e-3 (3.5e-3), gradients 1.2e-2 (4.3e-2), parameters 7.5e-3 (2.0e-2): the noise of bf16 itself, far below the
# factor-of-two errors this suite exists to catch (relative error 0.5 to 1).


LAYOUTS = [Layout(*case) for case in [
    ("tp2", TINY, ["parallel.tp=2"], 2, 1),
    ("pp2-gpipe", TINY, ["parallel.pp=2", "schedule=gpipe"], 2, 1),
    ("pp2-1f1b", TINY, ["parallel.pp=2", "schedule=1f1b"], 2, 1),
    ("pp4-gpipe", TINY, ["parallel.pp=4", "schedule=gpipe"], 4, 1),
    ("pp4-1f1b", TINY, ["parallel.pp=4", "schedule=1f1b"], 4, 1),
    ("dp2", TINY, ["parallel.dp=2"], 2, 2),
    ("tp2-pp2-1f1b", TINY, ["parallel.tp=2", "parallel.pp=2", "schedule=1f1b"], 4, 1),
    ("dp2-pp2-gpipe", TINY, ["parallel.dp=2", "parallel.pp=2", "schedule=gpipe"], 4, 2),

    ("uneven-5-layers-pp2", ["model=tiny", "model.num_hidden_layers=5"], ["parallel.pp=2"], 2, 1),
    ("explicit-1-3-1", ["model=tiny", "model.num_hidden_layers=5"],
     ["parallel.pp=3", "parallel.layers_per_stage=[1,3,1]"], 3, 1),
    ("moe-tp2-pp2", MOE, ["parallel.tp=2", "parallel.pp=2"], 4, 1),
    ("interleaved-pp2-vpp2", ["model=tiny", "model.num_hidden_layers=8"],
     ["parallel.pp=2", "parallel.vpp=2", "schedule=interleaved-1f1b"], 2, 1),
    ("interleaved-pp4-vpp2", ["model=tiny", "model.num_hidden_layers=8"],
     ["parallel.pp=4", "parallel.vpp=2", "schedule=interleaved-1f1b"], 4, 1),
    ("zb-h1-pp2", TINY, ["parallel.pp=2", "schedule=zb-h1"], 2, 1),
    ("zb-h1-pp4", TINY, ["parallel.pp=4", "schedule=zb-h1"], 4, 1),
    ("tp2-pp2-zb-h1", TINY, ["parallel.tp=2", "parallel.pp=2", "schedule=zb-h1"], 4, 1),
    ("zbv-pp2", TINY, ["parallel.pp=2", "parallel.vpp=2", "schedule=zbv"], 2, 1),
    ("table-zb-h1-pp2", TINY, ["parallel.pp=2", "schedule=table", f"schedule.path={TABLE}"], 2, 1),
    ("padded-dp2", PADDED, ["parallel.dp=2"], 2, 2),
    # Emulated pipelines: in this process (world 1) or one spawn per world size for all of them.
    ("padded-pp2-gpipe-emu", PADDED, ["parallel.pp=2", "schedule=gpipe", EMU], 1, 1),
    # A schedule from a module outside the core (the README's example; nothing under parallel/ names it).
    ("module-late-w-pp2-emu", TINY, ["parallel.pp=2", "schedule=module",
                                     "schedule.module=tests.late_w_schedule:one_f_one_b_late_w", EMU], 1, 1),
    ("interleaved-pp2-vpp3-emu", ["model=tiny", "model.num_hidden_layers=6"],
     ["parallel.pp=2", "parallel.vpp=3", "schedule=interleaved-1f1b", EMU], 1, 1),
    ("padded-dp2-pp2-1f1b-emu", PADDED, ["parallel.dp=2", "parallel.pp=2", EMU], 2, 2),
    ("dp2-pp2-zb-h1-emu", TINY, ["parallel.dp=2", "parallel.pp=2", "schedule=zb-h1", EMU], 2, 2),
    ("dp2-pp2-vpp2-interleaved-emu", ["model=tiny", "model.num_hidden_layers=8"],
     ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=interleaved-1f1b", EMU], 2, 2),
    ("dp2-pp2-zbv-emu", TINY, ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv", EMU], 2, 2),
    ("bf16-dp2-pp2-emu", BF16, ["parallel.dp=2", "parallel.pp=2", EMU], 2, 2),
    ("bf16-tp2-pp2-emu", BF16, ["parallel.tp=2", "parallel.pp=2", EMU], 2, 1),
    ("dp2-tp2-pp2-1f1b-emu", TINY, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", EMU], 4, 2),
    ("moe-top1-dp2-tp2-pp2-emu", MOE, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", EMU], 4, 2),
    ("moe-top2-dp2-tp2-pp2-emu", [*MOE, "model.num_experts_per_tok=2"],
     ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", EMU], 4, 2),
    ("untied-dp2-tp2-pp2-emu", UNTIED, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", EMU], 4, 2),
    # Validation through the pipeline under DP: the held-out loss at steps 2 and 3 equals one process's.
    ("validation-dp2-pp2-emu", ["model=tiny", "data.val_fraction=0.1", "train.eval_every=2", "train.eval_batches=2"],
     ["parallel.dp=2", "parallel.pp=2", EMU], 2, 2),
]] + FSDP_LAYOUTS  # parallel.zero=2/3 (tests/fsdp_layouts.py), in the same spawns


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A shared tokenizer cache, dense checkpoints per model, memoised baselines and grouped results."""
    return {"root": tmp_path_factory.mktemp("equivalence"), "dense": {}, "baselines": {}, "grouped": {},
            "factory": tmp_path_factory}


def dense_checkpoint(workspace, run_args: list[str]) -> str:
    """A .pth state_dict from a model with another seed, so loading it visibly replaces the initial weights."""
    key = tuple(a for a in run_args if a.startswith("model"))
    if key not in workspace["dense"]:
        from minimind import MiniMindForCausalLM

        cfg = compose_run_config(list(key), workspace["root"] / "cache")
        torch.manual_seed(7)
        path = workspace["root"] / f"dense-{len(workspace['dense'])}.pth"
        torch.save(MiniMindForCausalLM(model_config(cfg)).state_dict(), path)
        workspace["dense"][key] = str(path)
    return workspace["dense"][key]


def overrides(workspace, case: Layout) -> list[str]:
    """The layout's full override list, with its dense checkpoint and schedule table filled in."""
    layout = [arg.replace(TABLE, schedule_table(workspace)) for arg in case.layout]
    return [*STEPS, *case.run, *layout, f"checkpoint.load_dense={dense_checkpoint(workspace, case.run)}"]


def reference_run(workspace, case: Layout) -> dict:
    key = (tuple(case.run), case.dp)
    if key not in workspace["baselines"]:
        run_dir = workspace["root"] / f"baseline-{len(workspace['baselines'])}"
        load = f"checkpoint.load_dense={dense_checkpoint(workspace, case.run)}"
        workspace["baselines"][key] = baseline([*STEPS, *case.run, load], workspace["root"] / "cache", run_dir, case.dp)
    return workspace["baselines"][key]


def layout_results(workspace, case: Layout) -> list[dict]:
    """Every rank's results: spawned, in this process (emulated, world 1), or from its world size's group."""
    root, cache = workspace["root"], workspace["root"] / "cache"
    if not case.emulated:
        return run_workers(layout_worker, case.world, overrides(workspace, case), str(cache), str(root / case.name),
                           timeout=300)
    if case.world == 1:
        from parallel.grid import ParallelGrid

        cfg = compose_run_config(overrides(workspace, case), cache)
        return [run_training(cfg, ParallelGrid.single(torch.device("cpu")), root / case.name)]
    if case.name not in workspace["grouped"]:
        group = [c for c in LAYOUTS if c.emulated and c.world == case.world]

        def compute(shared: Path) -> dict[str, list[dict]]:
            runs = [(overrides(workspace, c), str(shared / c.name)) for c in group]
            by_rank = run_workers(layouts_worker, case.world, runs, str(cache), timeout=480)
            return {c.name: [r[i] for r in by_rank] for i, c in enumerate(group)}

        workspace["grouped"].update(once_per_session(workspace["factory"], f"equivalence-emulated-world{case.world}",
                                                     compute))
    return workspace["grouped"][case.name]


@pytest.mark.parametrize("case", LAYOUTS, ids=[case.name for case in LAYOUTS])
def test_layout_equals_single_process(workspace, case):
    reference = reference_run(workspace, case)
    results = layout_results(workspace, case)
    if "train.dtype=bf16" in case.run:
        fp32 = reference_run(workspace, dataclasses.replace(case, run=[*case.run, "train.dtype=fp32"]))
        assert_equivalent_bf16(results, reference, fp32)
    elif GATHER_BF16 in case.layout:
        bf16 = reference_run(workspace, dataclasses.replace(case, run=[*case.run, "train.dtype=bf16"]))
        assert_bf16_gathers(results, reference, bf16)
    else:
        assert_equivalent(results, reference, case.tol)
    if case in FSDP_LAYOUTS:
        assert_sharded(results, case)
    if any(a.startswith("train.eval_every") for a in case.run):
        assert {m["step"] for m in results[0]["metrics"] if "val_loss" in m} == {2, 3}
    cfg = compose_run_config(overrides(workspace, case), workspace["root"] / "cache")
    config = model_config(cfg)  # resolved: a field the preset leaves null is the family default
    if cfg.parallel.pp == 1 or not config.tie_word_embeddings:
        return
    if lower_pipeline(pipeline_spec(cfg), config.num_hidden_layers).placement == "v":
        # The first and last stage share rank 0: the tie is one Parameter, so no rank holds a second copy.
        assert not any(key == "lm_head.weight" for r in results for _, key, _ in r["tied"])
    else:
        assert_tied_copies_bitwise_equal(results, steps=3)


def schedule_table(workspace) -> str:
    """A CSV table dumped from the built-in zb-h1 (pp=2, 4 micro-batches), written once."""
    path = workspace["root"] / "zb-h1-pp2.csv"
    if not path.exists():
        dump_builtin("zb-h1", 2, 4, path)
    return str(path)


def assert_tied_copies_bitwise_equal(results: list[dict], steps: int) -> None:
    """The first stage's embedding and the last stage's lm_head are the same bits after every step."""
    copies: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}  # (dp, tp, step) -> name -> tensor
    for result in results:
        _, dp_rank, tp_rank = result["coords"]
        for step, name, tensor in result["tied"]:
            copies.setdefault((dp_rank, tp_rank, step), {})[name] = tensor
    assert copies and {step for _, _, step in copies} == set(range(1, steps + 1))
    for where, pair in copies.items():
        assert sorted(pair) == ["lm_head.weight", "model.embed_tokens.weight"], where
        assert torch.equal(pair["lm_head.weight"], pair["model.embed_tokens.weight"]), where


def test_padded_label_counts_differ_per_micro_batch_and_replica(tmp_path):
    """The padded cases above only prove the global token count if local counts actually differ."""
    from training.data import build_data

    cfg = compose_run_config([*STEPS, *PADDED], tmp_path / "cache")
    counts = [[[mb.num_label_tokens() for mb in build_data(cfg, d, 2)[0].batch(step)] for d in range(2)]
              for step in range(3)]
    for replicas in counts:
        assert all(len(set(replica)) > 1 for replica in replicas), counts  # between micro-batches
        assert sum(replicas[0]) != sum(replicas[1]), counts  # between the DP replicas of one step
