"""Expert parallelism (`parallel.ep`): every layout trains with one process's numbers, the dispatch bookkeeping is
a permutation and its inverse, and bad ep values are refused in one line.

The layouts of one world size share one spawn (`layouts_worker`); the single process is the equivalence harness's
gradient-accumulation baseline over the same micro-batches.
"""

import itertools
from pathlib import Path
from unittest import mock

import pytest
import torch

from parallel.expert import check_ep_divisibility, routing_of
from tests.equivalence import (Layout, Tolerances, _quantity, assert_equivalent, assert_equivalent_bf16, baseline,
                               layouts_worker, step_failures, tensor_failures)
from tests.shared import once_per_session, session_dir
from tests.spawn import run_workers
from training.config import ConfigError
from training.config.validate import validate

pytestmark = pytest.mark.timeout(1800)  # the module's shared spawns run inside its first tests

STEPS = ["train.steps=3", "schedule.n_microbatches=4"]
MOE = ["model=tiny-moe"]  # 4 experts, top-1
TOP2_8 = [*MOE, "model.num_experts=8", "model.num_experts_per_tok=2"]
QWEN3_MOE = ["model=qwen3-moe-tiny"]  # 4 experts, top-2, stacked
# bf16 against a bf16 single process, at tolerances derived from bf16 (tests.equivalence.bf16_tolerances): an expert's
# holder runs one bf16 matmul over the rows of every ep rank where the single process runs one per micro-batch, so its
# weight gradient is rounded to bf16 over other partial sums, and a token whose bf16 scores tie may go to the other
# expert. Measured ep2 against the derived bounds: loss 1.7e-5 (7.4e-4), aux loss 2.6e-4 (7.4e-4), grad norm 5.8e-4
# (7.3e-3), gradients 2.2e-3 (0.56: one bf16 process reroutes tokens away from an expert fp32 sends them to), parameters
# 4.2e-3 (8.8e-2), expert imbalance 3.1e-3 (1.5e-2).


LAYOUTS = [Layout(*case) for case in [
    ("ep2-dp2", MOE, ["parallel.dp=2", "parallel.ep=2"], 2, 2),
    ("ep2-dp4", MOE, ["parallel.dp=4", "parallel.ep=2"], 4, 4),
    ("ep2-pp2-1f1b", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "schedule=1f1b"], 4, 2),
    ("ep2-pp2-zb-h1", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "schedule=zb-h1"], 4, 2),
    ("ep2-tp2", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"], 4, 2),
    ("ep4-8-experts-top2", TOP2_8, ["parallel.dp=4", "parallel.ep=4"], 4, 4),
    # Composition: an emulated V-schedule pipeline with full recompute (the dispatch runs again in backward), and
    # selective recompute (each expert's SwiGLU) with validation (forward-only dispatch).
    ("ep2-pp2-zbv-emu-full-recompute", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.vpp=2",
                                             "schedule=zbv", "parallel.emulate=true", "train.recompute=full"], 2, 2),
    ("ep2-selective-recompute-validation", [*MOE, "data.val_fraction=0.1", "train.eval_every=2",
                                            "train.eval_batches=2"],
     ["parallel.dp=2", "parallel.ep=2", "train.recompute=selective"], 2, 2),
    ("ep2-bf16", [*MOE, "train.dtype=bf16"], ["parallel.dp=2", "parallel.ep=2"], 2, 2),
    # ZeRO-1: dense AdamW state sharded over DP, expert state over the edp group (2 ranks; 1 at dp2, unsharded).
    ("ep2-dp4-zero1", MOE, ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"], 4, 4),
    ("ep2-dp2-zero1", MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=1"], 2, 2),
    # transformers' Qwen3-MoE through its declared plans: stacked experts [E, 2I, H] / [E, H, I] sliced along E, run
    # by the module's own forward; under TP too (gate_up packed colwise, down rowwise) and in a ZB-H1 pipeline.
    ("qwen3-moe-ep2", QWEN3_MOE, ["parallel.dp=2", "parallel.ep=2"], 2, 2),
    ("qwen3-moe-ep2-tp2", QWEN3_MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"], 4, 2),
    ("qwen3-moe-ep4", QWEN3_MOE, ["parallel.dp=4", "parallel.ep=4"], 4, 4),
    ("qwen3-moe-ep2-pp2-zb-h1", QWEN3_MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "schedule=zb-h1"], 4, 2),
]]


MUTANT = "ep2-dp4-without-the-edp-sum"  # ep2-dp4 with a bug test_a_missing_edp_sum_is_caught must catch


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return {"root": tmp_path_factory.mktemp("expert_parallel"), "baselines": {}, "results": {},
            "factory": tmp_path_factory}


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
        group = [c for c in LAYOUTS if c.world == case.world]

        def compute(root: Path) -> dict[str, list[dict]]:
            runs = [([*STEPS, *c.run, *c.layout], str(root / c.name)) for c in group]
            # The mutant rides in the spawn of its layout's world size: a spawn of its own would cost one more start.
            mutants = [([*STEPS, *c.run, *c.layout], str(root / MUTANT)) for c in group if c.name == "ep2-dp4"]
            by_rank = run_workers(_layouts_then_mutants, case.world, runs, mutants, str(root / "cache"), timeout=900)
            names = [c.name for c in group] + [MUTANT] * len(mutants)
            return {name: [r[i] for r in by_rank] for i, name in enumerate(names)}

        workspace["results"].update(once_per_session(workspace["factory"], f"expert-parallel-world{case.world}",
                                                     compute))
    return workspace["results"][case.name]


@pytest.mark.parametrize("case", LAYOUTS, ids=[case.name for case in LAYOUTS])
def test_expert_parallel_layout_equals_single_process(workspace, case):
    results = layout_results(workspace, case)
    reference = reference_run(workspace, case)
    print(case.name, worst_errors(results, reference))  # seen with -s: the margins under the tolerances
    if "train.dtype=bf16" in case.run:
        fp32 = reference_run(workspace, Layout(case.name, [*case.run, "train.dtype=fp32"], [], case.world, case.dp))
        assert_equivalent_bf16(results, reference, fp32)
    else:
        assert_equivalent(results, reference, case.tol)
    ep = int(next(a for a in case.layout if a.startswith("parallel.ep=")).split("=")[1])
    # (name, slice) of each expert tensor held: a listed expert by its own name, stacked ones by their ep slice
    held = [{(name, block) for name, (*_, block) in r["params"].items() if name in r["experts"]}
            for r in results if r["coords"][1] < ep and r["coords"][2] == 0]
    assert all(held) and not set.intersection(*held), "each ep rank holds its own share of the experts"


def worst_errors(results: list[dict], reference: dict) -> dict[str, float]:
    """The largest relative error of each kind (loss, aux_loss, grad_norm, grads, params) against one process."""
    exact = Tolerances(0.0, 0.0, 0.0, 0.0)
    worst: dict[str, float] = {}
    for error, line in step_failures(results, reference, exact) + tensor_failures(results, reference, exact):
        kind = next((k for k in ("aux_loss", "grad_norm", "loss", "grads", "params") if k in _quantity(line)), "other")
        worst[kind] = max(worst.get(kind, 0.0), error)
    return {k: float(f"{v:.2g}") for k, v in sorted(worst.items())}


def _layouts_then_mutants(rank: int, world_size: int, runs: list, mutants: list, cache_dir: str) -> list[dict]:
    """The layouts, then the `mutants` with expert gradients left unsummed over the edp group (the mutant the suite
    must catch)."""
    from parallel.grid import ParallelGrid

    results = layouts_worker(rank, world_size, runs, cache_dir)
    with mock.patch.object(ParallelGrid, "edp", property(lambda grid: 1)):
        return results + layouts_worker(rank, world_size, mutants, cache_dir)


def test_a_missing_edp_sum_is_caught(workspace):
    case = next(c for c in LAYOUTS if c.name == "ep2-dp4")
    layout_results(workspace, case)  # its spawn runs the mutant after the layouts
    with pytest.raises(AssertionError, match=r"grads model\.layers\.\d\.mlp\.experts"):
        assert_equivalent(workspace["results"][MUTANT], reference_run(workspace, case))


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
    (["model=qwen3-moe-tiny", "parallel.dp=6", "parallel.ep=3"],
     "parallel.ep=3 does not divide model.num_experts=4; choose ep in {1, 2}"),
    (["model=tiny", "parallel.dp=2", "parallel.ep=2"],
     "parallel.ep=2 splits the experts of MoE layers, and this model has none (a dense model: see model.use_moe); "
     "set parallel.ep=1"),
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


# --- the grid's ep and edp groups -------------------------------------------------------------------------------------


def _ep_groups_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from parallel.grid import ParallelGrid

    grid = ParallelGrid.build(dp=2, tp=1, pp=2, backend="gloo", timeout_s=60, ep=2)
    members = {name: sorted(dist.get_process_group_ranks(getattr(grid, f"{name}_group")))
               for name in ("ep", "mp", "dp")}
    return {"coords": (grid.pp_rank, grid.dp_rank, grid.tp_rank), "ep_rank": grid.ep_rank, "edp": grid.edp,
            "edp_group": grid.edp_group, "members": members}


def test_ep_groups_are_carved_out_of_dp():
    results = run_workers(_ep_groups_worker, 4, timeout=300)
    for rank, r in enumerate(results):
        pp_rank, dp_rank, _ = r["coords"]
        assert rank == dp_rank + 2 * pp_rank and r["ep_rank"] == dp_rank and r["edp"] == 1
        assert r["edp_group"] is None  # dp == ep: every expert has one holder per ep group, nothing to sum
        assert r["members"]["ep"] == r["members"]["dp"] == [2 * pp_rank, 2 * pp_rank + 1]
        assert r["members"]["mp"] == [0, 1, 2, 3]  # the norm's group: pp x ep of the one edp replica


# --- checkpoints: saved EP-split, resumed in other layouts ---------------------------------------------------------

CKPT = ["train.steps=4", "checkpoint.every=2", "checkpoint.save_final=false"]  # AdamW state after 2 steps
EP2_PP2 = [*MOE, "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=2"]
EP1_PP2 = [*MOE, "parallel.dp=2", "parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=2"]
EP4 = [*MOE, "parallel.dp=4", "parallel.ep=4", "schedule.n_microbatches=1"]  # the same global batch of 8 sequences
EP2_DP4_ZERO1 = [*MOE, "parallel.dp=4", "parallel.ep=2", "parallel.zero=1", "schedule.n_microbatches=1"]
# Qwen3-MoE's stacked experts: saved as DTensors on the (ep, tp) mesh (gate_up packed: whole over tp), resumed at ep4
Q_EP2_TP2 = [*QWEN3_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "schedule.n_microbatches=2"]
Q_EP4 = [*QWEN3_MOE, "parallel.dp=4", "parallel.ep=4", "schedule.n_microbatches=1"]
STEP2 = "checkpoints/step_00000002"
RESUMES = [("ep2pp2", EP2_PP2, None), ("ep2pp2-resumed", EP2_PP2, "ep2pp2"), ("ep1pp2-from-ep2pp2", EP1_PP2, "ep2pp2"),
           ("ep4-from-ep2pp2", EP4, "ep2pp2"), ("ep4", EP4, None), ("ep1pp2", EP1_PP2, None),
           ("ep2dp4-zero1", EP2_DP4_ZERO1, None), ("ep2dp4-zero1-resumed", EP2_DP4_ZERO1, "ep2dp4-zero1"),
           ("ep4-from-ep2dp4-zero1", EP4, "ep2dp4-zero1"),
           ("qwen3-ep2tp2", Q_EP2_TP2, None), ("qwen3-ep2tp2-resumed", Q_EP2_TP2, "qwen3-ep2tp2"),
           ("qwen3-ep4-from-qwen3-ep2tp2", Q_EP4, "qwen3-ep2tp2"), ("qwen3-ep4", Q_EP4, None)]


def _resumes_worker(rank: int, world_size: int, root: str) -> list[dict]:
    from pathlib import Path

    from parallel.grid import ParallelGrid
    from tests.equivalence import compose_run_config, run_training

    results = []
    for name, layout, source in RESUMES:
        resume = [f"checkpoint.resume={Path(root) / source / STEP2}"] if source else []
        cfg = compose_run_config([*CKPT, *layout, *resume], Path(root) / "cache")
        p = cfg.parallel
        grid = ParallelGrid.build(p.dp, p.tp, p.pp, backend="gloo", timeout_s=120, ep=p.ep)
        results.append(run_training(cfg, grid, Path(root) / name))
    return results


@pytest.fixture(scope="module")
def ep_root(tmp_path_factory) -> Path:
    return session_dir(tmp_path_factory, "ep-checkpoints")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, ep_root) -> dict[str, list[dict]]:
    def compute(root: Path) -> dict[str, list[dict]]:
        by_rank = run_workers(_resumes_worker, 4, str(root), timeout=900)
        return {name: [r[i] for r in by_rank] for i, (name, _, _) in enumerate(RESUMES)}

    return once_per_session(tmp_path_factory, ep_root.name, compute)


@pytest.mark.parametrize("saved", ["ep2pp2", "ep2dp4-zero1", "qwen3-ep2tp2"])
def test_ep_checkpoint_resumes_bit_for_bit_in_its_own_layout(resumed, saved):
    """Under ZeRO-1 too: each rank saves the dense and the expert AdamW state it holds, and loads it back."""
    from tests.equivalence import assert_bitwise_resume

    assert_bitwise_resume(resumed[saved], resumed[f"{saved}-resumed"], start=2)


@pytest.mark.parametrize("run,saved,uninterrupted", [("ep1pp2-from-ep2pp2", "ep2pp2", "ep1pp2"),
                                                     ("ep4-from-ep2pp2", "ep2pp2", "ep4"),
                                                     ("ep4-from-ep2dp4-zero1", "ep2dp4-zero1", "ep4"),
                                                     ("qwen3-ep4-from-qwen3-ep2tp2", "qwen3-ep2tp2", "qwen3-ep4")])
def test_ep_checkpoint_reshards_to_another_ep(resumed, run, saved, uninterrupted):
    """Resumed at ep1 or ep4 (without ZeRO), the run continues the saved one (and equals the uninterrupted run of
    its own layout) within the suite's tolerances: another ep sums expert gradients in another order, so not bit
    for bit."""
    from tests.equivalence import dense_params

    straight = resumed[saved]
    for reference in (straight, resumed[uninterrupted]):
        for tail in resumed[run]:
            torch.testing.assert_close(torch.tensor(tail["losses"], dtype=torch.float64),
                                       torch.tensor(reference[0]["losses"][2:], dtype=torch.float64), rtol=1e-5, atol=0)
        tied = not run.startswith("qwen3")  # qwen3-moe-tiny has its own lm_head
        expected, got = dense_params(reference, tied), dense_params(resumed[run], tied)
        assert expected.keys() == got.keys()
        for name, tensor in expected.items():
            assert ((got[name] - tensor).norm() / tensor.norm()).item() <= 1e-4, name


@pytest.mark.parametrize("run", ["ep2pp2", "qwen3-ep2tp2"])
def test_an_ep_checkpoint_exports_the_trained_model(resumed, ep_root, tmp_path, run):
    """Expert-split checkpoints keep every expert under its dense name (a listed expert) or as one stacked tensor
    (Qwen3-MoE): the export is the model one process holds, loaded back by its own class."""
    from transformers import AutoModelForCausalLM

    from checkpoint.export import export_checkpoint
    from minimind import MiniMindForCausalLM
    from tests.equivalence import dense_params

    tied = run == "ep2pp2"  # MiniMind: its own format keeps the dense names (the stock export is test_stock_export's)
    folder = export_checkpoint(ep_root / run / "checkpoints" / "step_00000004", tmp_path / "hf",
                               "minimind" if tied else "hf")
    exported = (MiniMindForCausalLM if tied else AutoModelForCausalLM).from_pretrained(str(folder))
    trained = dense_params(resumed[run], tied)
    state = exported.state_dict()
    assert getattr(exported.config, "use_moe", True) and set(state) - {"lm_head.weight"} == set(trained) - {
        "lm_head.weight"}
    assert all(torch.equal(state[name], tensor) for name, tensor in trained.items())


# --- the dispatch itself, in two processes ----------------------------------------------------------------------------


def _dispatch_worker(rank: int, world_size: int, hot: bool, stacked: bool) -> dict:
    """ExpertDispatch of this rank's tokens over ep 2 against the experts of every rank's tokens in one process:
    outputs, token gradients and the local experts' gradients (the holder's gradient holds both ranks' tokens).
    Listed experts (a ModuleList of Linears, the loop written here) or stacked ones (transformers' Qwen3-MoE
    experts module, its own forward for the reference, sliced by the EP pass)."""
    import copy

    from torch import nn
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from parallel.expert import ExpertDispatch, ListedExperts, _split_stacked
    from parallel.grid import ParallelGrid

    grid = ParallelGrid.build(dp=2, tp=1, pp=1, backend="gloo", timeout_s=60, ep=2)
    generator = torch.Generator().manual_seed(3)
    if stacked:
        experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4))
        for param in experts.parameters():
            param.data = torch.randn(param.shape, generator=generator)
    else:
        experts = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))
        for expert in experts:
            expert.weight.data = torch.randn(8, 8, generator=generator)
    tokens = torch.randn(2, 5, 8, generator=generator)
    chosen = torch.stack([torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(5)])
                          for _ in range(2)])
    if hot:  # every token of both ranks goes to rank 0's experts: rank 1 receives nothing at all
        chosen = chosen % 2
        chosen[..., 1] = 1 - chosen[..., 0]
    weights = torch.rand(2, 5, 2, generator=generator)
    reference = copy.deepcopy(experts)
    ref_tokens = tokens.clone().requires_grad_()
    ref_out = torch.zeros_like(ref_tokens)
    for r in range(2):
        if stacked:
            ref_out[r] = reference(ref_tokens[r], chosen[r], weights[r])
            continue
        for e, expert in enumerate(reference):
            token_idx, slot = torch.where(chosen[r] == e)
            ref_out[r] = ref_out[r].index_add(0, token_idx, expert(ref_tokens[r][token_idx]) *
                                              weights[r][token_idx, slot, None])
    ref_out.pow(2).sum().backward()
    mine = tokens[rank].clone().requires_grad_()
    local = (2 * rank, 2 * rank + 1)
    if stacked:
        _split_stacked(experts, 4, grid)
        out = experts(mine, chosen[rank], weights[rank])
        held = list(experts.parameters())
        expected = lambda: [ref.grad[2 * rank:2 * rank + 2] for ref in reference.parameters()]  # noqa: E731
    else:
        kept = nn.ModuleDict({str(i): experts[i] for i in local})
        out = ExpertDispatch(ListedExperts(kept), 2, grid)(mine, chosen[rank], weights[rank])
        held = [kept[str(i)].weight for i in local]
        expected = lambda: [reference[i].weight.grad for i in local]  # noqa: E731
    out.pow(2).sum().backward()
    # Relative in norm: the stacked SwiGLU's outputs and gradients run to hundreds (random weights, a squared loss).
    expert_error = max(relative(p.grad, want) for p, want in zip(held, expected()))
    return {"out": relative(out, ref_out[rank]), "grad": relative(mine.grad, ref_tokens.grad[rank]),
            "experts": expert_error, "rows": int((chosen[rank] >= 2).sum()), "hot": hot}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in norm; 0 when both are zero (an expert that got no rows)."""
    return (got - want).norm().item() / max(want.norm().item(), 1e-12)


@pytest.mark.parametrize("stacked", [False, True], ids=["listed", "stacked"])
@pytest.mark.parametrize("hot", [False, True], ids=["spread", "one-rank-receives-nothing"])
def test_dispatch_equals_the_expert_loop_and_its_backward_completes(hot, stacked):
    results = run_workers(_dispatch_worker, 2, hot, stacked, timeout=120)
    for r in results:
        assert r["out"] < 1e-6 and r["grad"] < 1e-5 and r["experts"] < 1e-5, r
    if hot:
        assert all(r["rows"] == 0 for r in results)  # so rank 1's experts got no rows and its backward still ran


# --- tokens per expert (the load metric) -------------------------------------------------------------------------


def _rows_each_expert_receives(engine) -> torch.Tensor:
    """[layer, expert] rows the model's own forward hands each expert module (pre-hooks on the experts)."""
    import re

    rows = torch.zeros(4, 4, dtype=torch.float64)
    for chunk in engine.chunks():
        for name, module in chunk.module.named_modules():
            if found := re.fullmatch(r".*layers\.(\d+)\.mlp\.experts\.(\d+)", name):
                layer, expert = int(found[1]), int(found[2])
                module.register_forward_pre_hook(lambda _m, args, at=(layer, expert): rows.__setitem__(
                    at, rows[at] + args[0].shape[0]))
    return rows


def _moe_engine(pp: int, recompute: str):
    """The tiny MoE model (4 layers, 4 experts, top-1) in one process; pp 2 emulates a pipeline."""
    import dataclasses

    from parallel.engine import build_engine
    from parallel.expert_load import ExpertLoad
    from parallel.grid import ParallelGrid
    from tests.test_runtime import CPU, layout_cfg, tiny

    spec = dataclasses.replace(layout_cfg("1f1b" if pp > 1 else "gpipe", pp, 4), recompute=recompute)
    engine = build_engine(spec, tiny(moe=True), ParallelGrid.single(CPU))
    return engine, ExpertLoad(engine.chunks(), 4, 4, CPU)


def test_expert_load_counts_each_experts_tokens_once_per_step():
    from tests.test_runtime import batches

    micro_batches = batches(4)
    engine, load = _moe_engine(1, "none")
    rows = _rows_each_expert_receives(engine)
    engine.step(micro_batches)
    tokens = sum(mb.input_ids.numel() for mb in micro_batches)
    assert torch.equal(load.counts, rows) and load.counts.sum(1).tolist() == [tokens] * 4, (load.counts, rows)
    # A recompute that runs each layer's forward again inside the backward, a pipeline's pruned stacks, and a
    # validation forward count nothing more.
    again, pipelined = _moe_engine(2, "full")
    again.step(micro_batches)
    again.evaluate(micro_batches)
    assert torch.equal(pipelined.counts, load.counts), (pipelined.counts, load.counts)
    record = load.record(None, tp_rank=0)
    by_layer = [float(row.max() / row.mean()) for row in rows]
    assert record["expert_imbalance_by_layer"] == {f"layer{i}": v for i, v in enumerate(by_layer)}
    assert record["expert_imbalance"] == pytest.approx(sum(by_layer) / 4) and max(by_layer) > 1
    load.reset()
    assert load.record(None, tp_rank=0) == {}
