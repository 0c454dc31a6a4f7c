"""Every layout trains with the numbers of one process doing gradient accumulation (fp32, tiny models)."""

import pytest
import torch

from parallel.pipeline.plan import plan_pipeline
from training.specs import pipeline_spec
from parallel.pipeline.tables import dump_builtin
from tests.equivalence import assert_equivalent, baseline, compose_run_config, layout_worker
from tests.spawn import run_workers
from training.config import model_config

STEPS = ["train.steps=3", "schedule.n_microbatches=4"]
# (id, model overrides, layout overrides, world size, dp)
LAYOUTS = [
    ("tp2", ["model=tiny"], ["parallel.tp=2"], 2, 1),
    ("pp2-gpipe", ["model=tiny"], ["parallel.pp=2", "schedule=gpipe"], 2, 1),
    ("pp2-1f1b", ["model=tiny"], ["parallel.pp=2", "schedule=1f1b"], 2, 1),
    ("pp4-gpipe", ["model=tiny"], ["parallel.pp=4", "schedule=gpipe"], 4, 1),
    ("pp4-1f1b", ["model=tiny"], ["parallel.pp=4", "schedule=1f1b"], 4, 1),
    ("dp2", ["model=tiny"], ["parallel.dp=2"], 2, 2),
    ("tp2-pp2-1f1b", ["model=tiny"], ["parallel.tp=2", "parallel.pp=2", "schedule=1f1b"], 4, 1),
    ("dp2-pp2-gpipe", ["model=tiny"], ["parallel.dp=2", "parallel.pp=2", "schedule=gpipe"], 4, 2),
    ("dp2-tp2-pp2-1f1b", ["model=tiny"], ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"], 8, 2),
    ("uneven-5-layers-pp2", ["model=tiny", "model.num_hidden_layers=5"], ["parallel.pp=2"], 2, 1),
    ("explicit-1-3-1", ["model=tiny", "model.num_hidden_layers=5"],
     ["parallel.pp=3", "parallel.layers_per_stage=[1,3,1]"], 3, 1),
    ("moe-tp2-pp2", ["model=tiny-moe"], ["parallel.tp=2", "parallel.pp=2"], 4, 1),
    ("interleaved-pp2-vpp2", ["model=tiny", "model.num_hidden_layers=8"],
     ["parallel.pp=2", "parallel.vpp=2", "schedule=interleaved-1f1b"], 2, 1),
    ("interleaved-pp4-vpp2", ["model=tiny", "model.num_hidden_layers=8"],
     ["parallel.pp=4", "parallel.vpp=2", "schedule=interleaved-1f1b"], 4, 1),
    ("zb-h1-pp2", ["model=tiny"], ["parallel.pp=2", "schedule=zb-h1"], 2, 1),
    ("zb-h1-pp4", ["model=tiny"], ["parallel.pp=4", "schedule=zb-h1"], 4, 1),
    ("tp2-pp2-zb-h1", ["model=tiny"], ["parallel.tp=2", "parallel.pp=2", "schedule=zb-h1"], 4, 1),
    ("zbv-pp2", ["model=tiny"], ["parallel.pp=2", "parallel.vpp=2", "schedule=zbv"], 2, 1),
    ("table-zb-h1-pp2", ["model=tiny"], ["parallel.pp=2", "schedule=table", "schedule.path={table}"], 2, 1),
]
TABLE = "{table}"  # stands for a CSV dumped from a built-in schedule when the test runs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A shared tokenizer cache, dense checkpoints per model and memoised baselines."""
    return {"root": tmp_path_factory.mktemp("equivalence"), "dense": {}, "baselines": {}}


def dense_checkpoint(workspace, model_args: list[str]) -> str:
    """A .pth state_dict from a model with another seed, so loading it visibly replaces the initial weights."""
    key = tuple(model_args)
    if key not in workspace["dense"]:
        from minimind import MiniMindForCausalLM

        cfg = compose_run_config(model_args, workspace["root"] / "cache")
        torch.manual_seed(7)
        path = workspace["root"] / f"dense-{len(workspace['dense'])}.pth"
        torch.save(MiniMindForCausalLM(model_config(cfg)).state_dict(), path)
        workspace["dense"][key] = str(path)
    return workspace["dense"][key]


def reference_run(workspace, model_args: list[str], dp: int, load: list[str]) -> dict:
    key = (tuple(model_args), dp)
    if key not in workspace["baselines"]:
        run_dir = workspace["root"] / f"baseline-{len(workspace['baselines'])}"
        workspace["baselines"][key] = baseline([*STEPS, *model_args, *load], workspace["root"] / "cache", run_dir, dp)
    return workspace["baselines"][key]


@pytest.mark.parametrize("name, model_args, layout, world, dp", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_layout_equals_single_process(workspace, name, model_args, layout, world, dp):
    layout = [arg.replace(TABLE, schedule_table(workspace)) if TABLE in arg else arg for arg in layout]
    load = [f"checkpoint.load_dense={dense_checkpoint(workspace, model_args)}"]
    reference = reference_run(workspace, model_args, dp, load)
    results = run_workers(layout_worker, world, [*STEPS, *model_args, *layout, *load],
                          str(workspace["root"] / "cache"), str(workspace["root"] / name), timeout=300)
    assert_equivalent(results, reference)
    cfg = compose_run_config([*STEPS, *model_args, *layout], workspace["root"] / "cache")
    pp = cfg.parallel.pp
    if pp > 1 and plan_pipeline(pipeline_spec(cfg), cfg.model.num_hidden_layers).placement == "v":
        # The first and last stage share rank 0: the tie is one Parameter, so no rank holds a second copy.
        assert not any(key == "lm_head.weight" for r in results for _, key, _ in r["tied"])
    elif pp > 1:
        assert_tied_copies_bitwise_equal(results, pp)


def schedule_table(workspace) -> str:
    """A CSV table dumped from the built-in zb-h1 (pp=2, 4 micro-batches), written once."""
    path = workspace["root"] / "zb-h1-pp2.csv"
    if not path.exists():
        dump_builtin("zb-h1", 2, 4, path)
    return str(path)


def assert_tied_copies_bitwise_equal(results: list[dict], pp: int) -> None:
    """The first stage's embedding and the last stage's lm_head are the same bits after every step."""
    by_coords = {r["coords"]: r["tied"] for r in results}
    checked = 0
    for (pp_rank, dp_rank, tp_rank), copies in by_coords.items():
        if pp_rank != 0:
            continue
        head = by_coords[(pp - 1, dp_rank, tp_rank)]
        assert [step for step, _, _ in copies] == [step for step, _, _ in head] == [1, 2, 3]
        for (_, first_name, first), (_, last_name, last) in zip(copies, head):
            assert (first_name, last_name) == ("model.embed_tokens.weight", "lm_head.weight")
            assert torch.equal(first, last)
            checked += 1
    assert checked > 0
