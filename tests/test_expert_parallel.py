"""Expert parallelism (`parallel.ep`): every layout trains with one process's numbers, the dispatch bookkeeping is
a permutation and its inverse, and bad ep values are refused in one line.

The layouts of one world size share one spawn (`layouts_worker`); the single process is the equivalence harness's
gradient-accumulation baseline over the same micro-batches.
"""

import itertools
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from parallel.expert import check_ep_divisibility, routing_of
from tests.equivalence import assert_equivalent, baseline, layouts_worker
from tests.spawn import run_workers
from training.config import ConfigError, validate

pytestmark = pytest.mark.timeout(1800)  # the module's shared spawns run inside its first tests

STEPS = ["train.steps=3", "schedule.n_microbatches=4"]
MOE = ["model=tiny-moe"]  # 4 experts, top-1
TOP2_8 = [*MOE, "model.num_experts=8", "model.num_experts_per_tok=2"]


@dataclass(frozen=True)
class Layout:
    """One acceptance layout: `run` the baseline shares, `layout` only the layout has."""

    name: str
    run: list[str]
    layout: list[str]
    world: int
    dp: int


LAYOUTS = [Layout(*case) for case in [
    ("ep2-dp2", MOE, ["parallel.dp=2", "parallel.ep=2"], 2, 2),
    ("ep2-dp4", MOE, ["parallel.dp=4", "parallel.ep=2"], 4, 4),
    ("ep2-pp2-1f1b", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "schedule=1f1b"], 4, 2),
    ("ep2-pp2-zb-h1", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "schedule=zb-h1"], 4, 2),
    ("ep2-tp2", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"], 4, 2),
    ("ep4-8-experts-top2", TOP2_8, ["parallel.dp=4", "parallel.ep=4"], 4, 4),
]]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return {"root": tmp_path_factory.mktemp("expert_parallel"), "baselines": {}, "results": {}}


def reference_run(workspace, case: Layout) -> dict:
    key = (tuple(case.run), case.dp)
    if key not in workspace["baselines"]:
        root = workspace["root"]
        workspace["baselines"][key] = baseline([*STEPS, *case.run], root / "cache",
                                               root / f"baseline-{len(workspace['baselines'])}", case.dp)
    return workspace["baselines"][key]


def layout_results(workspace, case: Layout) -> list[dict]:
    """Every rank's results; the layouts of one world size run in one spawn."""
    if case.name not in workspace["results"]:
        root = workspace["root"]
        group = [c for c in LAYOUTS if c.world == case.world]
        runs = [([*STEPS, *c.run, *c.layout], str(root / c.name)) for c in group]
        by_rank = run_workers(layouts_worker, case.world, runs, str(root / "cache"), timeout=900)
        workspace["results"].update({c.name: [r[i] for r in by_rank] for i, c in enumerate(group)})
    return workspace["results"][case.name]


@pytest.mark.parametrize("case", LAYOUTS, ids=[case.name for case in LAYOUTS])
def test_expert_parallel_layout_equals_single_process(workspace, case):
    results = layout_results(workspace, case)
    assert_equivalent(results, reference_run(workspace, case))
    ep = int(next(a for a in case.layout if a.startswith("parallel.ep=")).split("=")[1])
    held = [set(r["experts"]) for r in results if r["coords"][1] < ep and r["coords"][2] == 0]
    assert all(held) and not set.intersection(*held), "each ep rank holds its own share of the experts"


def _forgot_edp_sum(rank: int, world_size: int, *args) -> list[dict]:
    """The layouts with expert gradients left unsummed over the edp group (the mutant the suite must catch)."""
    from parallel import engine

    with mock.patch.object(engine.ParallelGrid, "edp", property(lambda grid: 1)):
        return layouts_worker(rank, world_size, *args)


def test_a_missing_edp_sum_is_caught(workspace):
    case = next(c for c in LAYOUTS if c.name == "ep2-dp4")
    root = workspace["root"]
    runs = [([*STEPS, *case.run, *case.layout], str(root / "mutant"))]
    results = [r[0] for r in run_workers(_forgot_edp_sum, case.world, runs, str(root / "cache"), timeout=600)]
    with pytest.raises(AssertionError, match=r"grads model\.layers\.\d\.mlp\.experts"):
        assert_equivalent(results, reference_run(workspace, case))


# --- the dispatch bookkeeping, in one process ------------------------------------------------------------------------


def simulated_dispatch(choices: list[torch.Tensor], n_experts: int) -> list[torch.Tensor]:
    """Each rank's rows as its experts see them, moving rows between `len(choices)` simulated ep ranks as the
    all_to_alls would, each expert e scaling its rows by e + 1; returned to their source and un-permuted."""
    ep, local = len(choices), n_experts // len(choices)
    sent = [torch.bincount(c.reshape(-1), minlength=n_experts) for c in choices]
    routings = [routing_of(c, sent[r], torch.stack([sent[s].view(ep, local)[r] for s in range(ep)]))
                for r, c in enumerate(choices)]
    rows = [torch.arange(c.numel(), dtype=torch.float64) + 1000 * r for r, c in enumerate(choices)]  # row ids
    outbox = [list(rows[r][routings[r].order].split(routings[r].send_counts)) for r in range(ep)]
    inbox = [torch.cat([outbox[s][r] for s in range(ep)]) for r in range(ep)]
    replies = []
    for r in range(ep):
        by_expert = inbox[r][routings[r].by_expert]
        scale = torch.cat([torch.full((n,), float(r * local + j + 1))
                           for j, n in enumerate(routings[r].expert_counts)])
        back = torch.empty_like(by_expert)
        back[routings[r].by_expert] = by_expert * scale
        replies.append(list(back.split(routings[r].recv_counts)))
    results = []
    for r in range(ep):
        returned = torch.cat([replies[s][r] for s in range(ep)])
        out = torch.empty_like(returned)
        out[routings[r].order] = returned
        results.append(out)
    return results


@pytest.mark.parametrize("ep,n_experts,k", [(2, 4, 1), (2, 4, 2), (4, 8, 2), (3, 3, 1)])
def test_dispatch_reaches_each_rows_expert_and_returns_it_in_place(ep, n_experts, k):
    generator = torch.Generator().manual_seed(ep * 100 + n_experts * 10 + k)
    choices = [torch.stack([torch.randperm(n_experts, generator=generator)[:k] for _ in range(7 + 3 * r)])
               for r in range(ep)]
    choices[0][:, 0] = 0  # one expert hot, so some experts get no rows from rank 0
    for r, (got, chosen) in enumerate(zip(simulated_dispatch(choices, n_experts), choices)):
        ids = torch.arange(chosen.numel(), dtype=torch.float64) + 1000 * r
        assert torch.equal(got, ids * (chosen.reshape(-1).double() + 1)), (r, got)


def test_routing_counts_and_the_expert_major_regrouping():
    # ep 2, 4 experts. As rank 0 (experts 0, 1): its rows go 2 to itself (expert 0) and 3 to rank 1 (experts 2, 3).
    chosen = torch.tensor([[3], [0], [2], [3], [0]])
    sent = torch.bincount(chosen.reshape(-1), minlength=4)
    routing = routing_of(chosen, sent, torch.tensor([[2, 0], [0, 3]]))
    assert routing.order.tolist() == [1, 4, 2, 0, 3]  # by expert, each expert's rows in token order
    assert routing.send_counts == [2, 3] and routing.recv_counts == [2, 3] and routing.expert_counts == [2, 3]
    # As rank 1 (experts 2, 3): rank 0 sends [e2, e3, e3], rank 1 itself [e2, e2, e2]; regrouped expert-major.
    routing = routing_of(torch.tensor([[2], [2], [2]]), torch.tensor([0, 0, 3, 0]), torch.tensor([[1, 2], [3, 0]]))
    assert routing.by_expert.tolist() == [0, 3, 4, 5, 1, 2] and routing.expert_counts == [4, 2]


def test_zero_rows_everywhere_is_a_valid_routing():
    routing = routing_of(torch.zeros(4, 1, dtype=torch.long), torch.tensor([4, 0]), torch.tensor([[0], [0]]))
    assert routing.recv_counts == [0, 0] and routing.by_expert.numel() == 0 and routing.send_counts == [4, 0]


# --- one-line refusals -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (["model=tiny-moe", "parallel.dp=2", "parallel.ep=3"],
     "parallel.ep=3 does not divide model.num_experts=4; choose ep in {1, 2}"),
    (["model=tiny-moe", "model.num_experts=6", "parallel.dp=4", "parallel.ep=3"],
     "parallel.ep=3 does not divide the data-parallel size parallel.dp=4; choose ep in {1, 2}"),
    (["model=tiny", "parallel.dp=2", "parallel.ep=2"],
     "parallel.ep=2 splits the experts of MoE layers, and this model has none (a dense model: see model.use_moe); "
     "set parallel.ep=1"),
    (["model=tiny-moe", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1"],
     "parallel.zero=1 shards the optimizer state over all DP ranks, and parallel.ep=2 keeps each expert on only some "
     "of them; use parallel.zero=0 with parallel.ep>1"),
])
def test_bad_ep_is_refused_in_one_line(tmp_path, overrides, message):
    from tests.equivalence import compose_run_config

    cfg = compose_run_config(overrides, tmp_path / "cache")
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert str(error.value) == message


def test_divisibility_names_the_choices():
    with pytest.raises(ValueError, match=r"choose ep in \{1, 2, 4\}"):
        check_ep_divisibility(8, 4, 3)
    for ep, (experts, dp) in itertools.product([1, 2], [(4, 2), (8, 4)]):
        check_ep_divisibility(experts, dp, ep)
