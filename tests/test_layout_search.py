"""The layout search (fake predictor, in-process), `scripts/preview.py --search` and `parallel.layout=auto` at launch."""

import dataclasses
import json
import os
import subprocess
from multiprocessing.pool import ThreadPool
from pathlib import Path
import sys
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from tests.conftest import ROOT
from tests.shared import once_per_session
from training.config import CONF_DIR, register_schema
from training.layout_search.costs import MeasuredCosts
from training.layout_search.predict import Candidate, Prediction, predict
from training.layout_search.search import GIB, apply_candidate, search
from training.layout_search.search_report import no_fit_message

# Four ranks of the tiny model (4 layers, 4 heads, 2 kv heads) at a global batch of 3 x 2 = 6 sequences.
TINY = ["model=tiny", "schedule.n_microbatches=3", "train.micro_batch_size=2", "train.seq_len=32"]
EXTRA_TIME = {"none": 1.0, "selective": 1.1, "full": 1.3}
KEPT = {"none": 1.0, "selective": 0.5, "full": 0.25}


def fake_costs() -> MeasuredCosts:
    """Costs of nothing in particular (the fake predictor ignores them): every field filled by its type."""
    def value(f: dataclasses.Field):
        if f.name == "key":
            return {"micro_batch_size": 2}
        return dict.fromkeys(("none", "selective", "full"), 1) if "dict" in str(f.type) else 1
    return MeasuredCosts(**{f.name: value(f) for f in dataclasses.fields(MeasuredCosts)
                            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})


def compose_cfg(*overrides: str):
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, *overrides])
    GlobalHydra.instance().clear()
    return cfg


def fake_predict(c: Candidate, cfg, costs) -> Prediction:
    """Bubble-aware step time (a second more per ZeRO level) and a peak of 1 GiB of weights per layer (1/dp of it at
    zero=3) plus 1 GiB per live micro-batch and layer."""
    layers = cfg.model.num_hidden_layers / (c.pp * c.tp)
    live = c.n_microbatches if c.schedule == "gpipe" else min(c.pp, c.n_microbatches)
    discount = 0.9 if c.schedule in ("zb-h1", "zbv") else 1.0
    step = (c.n_microbatches + (c.pp - 1) * discount) * c.micro_batch_size * layers * EXTRA_TIME[c.recompute] + c.zero
    peak = int(GIB * layers * ((1 / c.dp if c.zero == 3 else 1) + live * c.micro_batch_size * KEPT[c.recompute]))
    return Prediction(step_s=step, peak_bytes=(peak,) * c.pp, sim=None)


def reasons(result) -> dict[str, str]:
    return {" ".join(r.candidate.overrides()): r.reason for r in result.rejected}


def test_search_ranks_the_valid_layouts_and_rejects_the_rest_with_reasons():
    result = search(compose_cfg("parallel.memory_budget_gb=4"), 4, fake_costs(), fake_predict)
    assert result.global_batch == 6
    for option in result.options:  # the global batch is held and the world filled
        c = option.candidate
        assert (c.dp * c.n_microbatches * c.micro_batch_size, c.dp * c.tp * c.pp) == (6, 4)
    fitting = [o for o in result.options if o.fits]
    assert fitting and [o.step_s for o in fitting] == sorted(o.step_s for o in fitting)
    assert result.best is fitting[0] and all(o.peak <= 4 * GIB for o in fitting)
    why = list(result.rejected)
    assert any(r.reason == "the global batch of 6 sequences does not split over dp=4" for r in why)
    assert any(r.candidate.tp == 4 and r.reason == "parallel.tp=4 does not divide num_key_value_heads=2; "
               "choose tp in {1, 2}" for r in why)
    assert any(r.candidate.schedule == "interleaved-1f1b" and r.candidate.pp == 2 and r.reason ==
               "schedule 'interleaved-1f1b' needs schedule.n_microbatches to be a multiple of parallel.pp "
               "(got 3 and 2); set schedule.n_microbatches=4" for r in why)
    assert any(r.candidate.vpp * r.candidate.pp == 8 and r.reason == "parallel.pp*parallel.vpp = 8 stages but the "
               "model has 4 layers; use at most 4 stages" for r in why)
    # Over the budget without recompute: refused with its peak, then tried again with recomputation.
    gpipe = Candidate(dp=1, tp=2, pp=2, vpp=1, schedule="gpipe", n_microbatches=6, micro_batch_size=1,
                      recompute="none")
    assert reasons(result)[" ".join(gpipe.overrides())] == ("predicted peak 7 GiB per rank exceeds "
                                                             "parallel.memory_budget_gb=4")
    assert replace(gpipe, recompute="selective") in [o.candidate for o in fitting]  # 4 GiB: fits, so no `full`
    assert replace(gpipe, recompute="full") not in [o.candidate for o in result.options]


def test_recompute_is_tried_only_where_the_cheaper_mode_does_not_fit():
    result = search(compose_cfg(), 2, fake_costs(), fake_predict)  # no budget: everything fits
    assert result.rejected == [] or all(not r.reason.startswith("predicted") for r in result.rejected)
    assert {o.candidate.recompute for o in result.options} == {"none"}
    # dp2 x b1, tp2 x b2 and tp2 x b1 all predict 12 s: the tie goes to the larger micro-batch.
    tied = [o.candidate for o in result.options if o.step_s == 12]
    assert len(tied) == 3 and tied[0] == result.best.candidate
    assert result.best.candidate == Candidate(dp=1, tp=2, pp=1, vpp=1, schedule="1f1b", n_microbatches=3,
                                              micro_batch_size=2, recompute="none")


def test_a_budget_nothing_fits_gives_one_line_with_the_closest_peak_and_what_would_fit():
    cfg = compose_cfg("parallel.memory_budget_gb=2")
    result = search(cfg, 2, fake_costs(), fake_predict)
    assert result.best is None
    assert no_fit_message(result, cfg, fake_costs()) == (
        "no layout of 2 ranks fits parallel.memory_budget_gb=2: the smallest predicted peak is 2.5 GiB per rank "
        "(dp=1 tp=2 pp=1 vpp=1 1f1b m=6 b=1 recompute=full layers=even); would fit: world_size=4 with "
        "parallel.pp=2 (1.5 GiB)")
    cfg = compose_cfg("parallel.memory_budget_gb=0.1")
    result = search(cfg, 2, fake_costs(), fake_predict)
    assert no_fit_message(result, cfg, fake_costs()) == (
        "no layout of 2 ranks fits parallel.memory_budget_gb=0.1: the smallest predicted peak is 2.5 GiB per rank "
        "(dp=1 tp=2 pp=1 vpp=1 1f1b m=6 b=1 recompute=full layers=even); neither up to 8x the ranks, "
        "recompute=full nor a smaller micro-batch fits: raise parallel.memory_budget_gb to at least 2.5")


def test_applying_a_candidate_equals_composing_its_overrides():
    cfg = compose_cfg("parallel.layout=auto")
    c = Candidate(dp=1, tp=1, pp=2, vpp=1, schedule="zb-h1", n_microbatches=6, micro_batch_size=1,
                  recompute="selective", layers_per_stage=(3, 1))
    expected = OmegaConf.to_container(compose_cfg(*c.overrides()), resolve=True)
    assert OmegaConf.to_container(apply_candidate(cfg, c), resolve=True) == expected
    moe = compose_cfg("parallel.layout=auto", "model=tiny-moe")
    c = replace(c, dp=2, pp=1, layers_per_stage=None, ep=2, zero=2)
    expected = OmegaConf.to_container(compose_cfg("model=tiny-moe", *c.overrides()), resolve=True)
    assert OmegaConf.to_container(apply_candidate(moe, c), resolve=True) == expected


def test_a_moe_model_is_searched_over_every_expert_split_of_its_dp_ranks():
    """ep divides the DP size and the experts (6 experts at dp=4: ep 1 or 2); a dense model stays at ep=1."""
    def splits(*overrides: str) -> dict[int, set[int]]:
        result = search(compose_cfg("schedule.n_microbatches=2", "train.micro_batch_size=2", *overrides), 4,
                        fake_costs(), fake_predict)
        found: dict[int, set[int]] = {}
        for option in result.options:
            found.setdefault(option.candidate.dp, set()).add(option.candidate.ep)
        assert not [r for r in result.rejected if "parallel.ep" in r.reason], "every split tried is a valid one"
        return found

    assert splits("model=tiny-moe") == {1: {1}, 2: {1, 2}, 4: {1, 2, 4}}
    assert splits("model=tiny-moe", "model.num_experts=6") == {1: {1}, 2: {1, 2}, 4: {1, 2}}
    assert splits() == {1: {1}, 2: {1}, 4: {1}}


def test_a_model_that_fits_only_sharded_is_chosen_with_zero_3_and_the_ranking_shows_it():
    """One layer with one KV head on 2 ranks: dp=2 is the only layout (no TP split of one KV head, no second stage).
    The real memory model at 1000 parameters of 4 bytes: zero=0 16 KB, 1 12 KB, 2 14 KB, 3 8 KB, plus 50 B of
    activations (5 B at recompute=full); within 10 KB only zero=3 fits, whatever the recompute mode."""
    from tests.test_layout_search_predict import fake_costs as round_costs
    from training.layout_search.search_report import chosen, table

    cfg = compose_cfg("model.num_hidden_layers=1", "model.num_key_value_heads=1", "parallel.memory_budget_gb=1e-5")
    result = search(cfg, 2, round_costs(), predict)
    assert {o.candidate.zero for o in result.options} == {0, 1, 2, 3}
    assert [o.candidate.zero for o in result.options if o.fits] == [3]
    assert result.best.candidate.zero == 3 and result.best.peak == 8050
    assert "parallel.zero=3" in chosen(result.best).split()  # the `parallel.layout=auto chose ...` line names it
    assert any("zero=3" in line.split() and line.split()[-1] == "yes" for line in table(result))
    assert apply_candidate(cfg, result.best.candidate).parallel.zero == 3


def test_a_zero_level_the_config_sets_is_kept():
    """0 (the default) lets the search shard where dp >= 2; a level set is kept, and refused where it cannot run."""
    searched = search(compose_cfg(), 2, fake_costs(), fake_predict)
    assert {(o.candidate.dp, o.candidate.zero) for o in searched.options} == {(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)}
    assert searched.best.candidate.zero == 0  # no budget: the fake's extra second per level is not worth paying
    kept = search(compose_cfg("parallel.zero=3"), 2, fake_costs(), fake_predict)
    assert {(o.candidate.dp, o.candidate.zero) for o in kept.options} == {(2, 3)}
    assert any(r.candidate.dp == 1 and r.reason.startswith("parallel.zero=3 shards over the data-parallel ranks and "
                                                           "this layout has one (dp=1)") for r in kept.rejected)
    fsdp_only = search(compose_cfg("parallel.mixed_precision_param=bf16"), 2, fake_costs(), fake_predict)
    assert {(o.candidate.dp, o.candidate.zero) for o in fsdp_only.options} == {(2, 2), (2, 3)}  # bf16 gathers are FSDP's
    assert any(r.candidate.zero == 0 and r.reason.startswith("parallel.mixed_precision_param=bf16 is read only when "
                                                             "parallel.zero=2|3") for r in fsdp_only.rejected)


@pytest.fixture(scope="module")
def costs_cache(tmp_path_factory) -> Path:
    """One data and cost cache for the module: the layouts' costs are measured once, then read."""
    return tmp_path_factory.mktemp("costs-cache")


def preview_script(*args: str, tmp_path, capsys) -> tuple[int, str, str]:
    """`scripts/preview.py --search` run in this process: exit code, stdout, stderr."""
    from tests.test_preview import load_preview_module

    try:
        code = load_preview_module().main(["--search", *TINY, f"data.cache_dir={tmp_path}", *args])
    except SystemExit as leave:
        code = leave.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_preview_search_prints_the_ranking_and_draws_the_best(tmp_path, costs_cache, capsys):
    out = tmp_path / "best.png"
    code, stdout, stderr = preview_script("world_size=2", "parallel.memory_budget_gb=8", f"--out={out}",
                                       tmp_path=costs_cache, capsys=capsys)
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0] == "search: 2 ranks, global batch 6 sequences of 32 tokens, memory budget 8 GiB per rank"
    assert lines[1].split() == ["rank", "candidate", "step", "s", "peak/rank", "fits"]
    assert lines[2].split()[0] == "1" and lines[2].split()[-1] == "yes"
    best = next(line for line in lines if line.startswith("best: "))
    assert best.startswith("best: parallel.dp=") and " s/step, peak " in best
    assert any("does not divide" in line or "stages but the model has" in line for line in lines)
    assert f"timeline: {out}" in lines and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_preview_search_without_a_fitting_layout_exits_2_with_one_line(costs_cache, capsys):
    code, _, stderr = preview_script("world_size=2", "parallel.memory_budget_gb=1e-6", tmp_path=costs_cache,
                                  capsys=capsys)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1
    assert stderr.startswith("sluice: config error: no layout of 2 ranks fits parallel.memory_budget_gb=1e-06: "
                                  "the smallest predicted peak is ")


# --- parallel.layout=auto end to end: two processes of the tiny model. ---------------------------------------

RUN = ["train.steps=2", "data.num_docs=300", "logger=none", "train.dtype=fp32", "train.log_every=1",
       "optim.warmup_steps=0", "parallel.layout=auto", "parallel.memory_budget_gb=8"]


def train(launcher: list[str], run_dir: Path, cache: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run train.py with layout=auto; the process result and the layout its final checkpoint recorded."""
    cmd = [*launcher, "train.py", *TINY, *RUN, f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads(next((run_dir / "checkpoints").glob("step_*/meta.json")).read_text())
    return proc, meta["layout"]


def chosen_layout(stdout: str) -> dict:
    """The layout announced by `sluice: parallel.layout=auto chose ...`, as the checkpoint records it."""
    [line] = [x for x in stdout.splitlines() if x.startswith("sluice: parallel.layout=auto chose ")]
    pairs = dict(tok.split("=", 1) for tok in line.split(" (predicted")[0].split()[3:])
    keys = {"dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "vpp": "parallel.vpp",
            "schedule": "schedule", "n_microbatches": "schedule.n_microbatches",
            "micro_batch_size": "train.micro_batch_size"}
    chosen = {k: pairs[v] if k == "schedule" else int(pairs[v]) for k, v in keys.items()}
    return {**chosen, "ep": int(pairs.get("parallel.ep", 1))}  # named only where it splits experts


TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.fixture(scope="module")
def layout_auto_runs(tmp_path_factory, costs_cache) -> dict[str, tuple[subprocess.CompletedProcess, dict]]:
    """`run_layout_auto`, once per session: pytest-xdist's work stealing may hand this module's tests to both workers."""
    return once_per_session(tmp_path_factory, "layout-auto", lambda root: run_layout_auto(root, costs_cache))


def run_layout_auto(base: Path, costs_cache: Path) -> dict[str, tuple[subprocess.CompletedProcess, dict]]:
    """Two layout=auto runs side by side (their start-ups overlap): two self-launched workers (parallel.dp=2 makes the
    world), and two torchrun ranks."""
    runs = {"self-launch": ([sys.executable], ["parallel.dp=2"]),
            "torchrun": ([TORCHRUN, "--standalone", "--nproc-per-node", "2"], [])}
    if not os.path.exists(TORCHRUN):  # its test is skipped
        del runs["torchrun"]
    with ThreadPool(len(runs)) as pool:
        results = pool.map(lambda name: train(runs[name][0], base / name, costs_cache, *runs[name][1]), runs)
    return dict(zip(runs, results))


def test_layout_auto_runs_the_chosen_layout_on_two_self_launched_workers(layout_auto_runs):
    proc, layout = layout_auto_runs["self-launch"]
    assert layout == chosen_layout(proc.stdout)
    assert layout["dp"] * layout["tp"] * layout["pp"] == 2
    assert layout["dp"] * layout["n_microbatches"] * layout["micro_batch_size"] == 12  # as written: dp=2 x 3 x 2


def test_layout_auto_without_a_fitting_layout_is_one_config_error_line(tmp_path, costs_cache, capsys):
    """train.py's path in this process (tests/test_config_errors.py's launch_here): refused before any worker."""
    from tests.test_config_errors import launch_here

    result = launch_here([*TINY, *RUN[:-1], "parallel.memory_budget_gb=1e-6", f"data.cache_dir={costs_cache}",
                          f"hydra.run.dir={tmp_path}/run"], capsys)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("sluice: config error: no layout of 1 rank fits parallel.memory_budget_gb=1e-06: the "
                           "smallest predicted peak is ")
    assert "raise parallel.memory_budget_gb to at least " in line


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="no torchrun")
def test_layout_auto_under_torchrun_every_rank_runs_rank_zeros_choice(layout_auto_runs):
    proc, layout = layout_auto_runs["torchrun"]
    assert proc.stdout.count("sluice: parallel.layout=auto chose ") == 1  # rank 0 chose, once
    assert layout == chosen_layout(proc.stdout)


def test_accuracy_bench_candidates_are_valid_two_process_layouts_at_one_global_batch(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import layout_search_accuracy as bench

    from training.layout_search.search import global_batch, layout_problem

    cfg = bench.compose_cfg(tmp_path)
    assert (cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.train.seq_len) == (8, 256, 128)
    assert len(set(bench.CANDIDATES)) >= 6 and {c.schedule for c in bench.CANDIDATES} >= {"1f1b", "gpipe", "zb-h1"}
    for c in bench.CANDIDATES:
        assert layout_problem(cfg, c, bench.WORLD) is None, c
        assert c.dp * c.n_microbatches * c.micro_batch_size == global_batch(cfg)
    assert bench.spearman([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0]) == pytest.approx(0.8)
    assert bench.ranks([2.0, 1.0, 2.0]) == [2.5, 1.0, 2.5]
