"""Measured costs: what the profiler counts equals the memory model, the cache round-trips, the CLI runs."""

import importlib.util

import pytest
import torch

from models.minimind import saved_activation_bytes_per_layer
from tests.conftest import ROOT
from tests.equivalence import compose_run_config
from training.config import model_config
from training.layout_search.costs import Fit, MeasuredCosts, cache_path, cost_key, load_cached, save
from training.layout_search.profile import measure_compute

CPU = torch.device("cpu")


def test_measured_pieces_match_the_memory_model_and_the_parameter_counts(tmp_path):
    cfg = compose_run_config(["model=tiny", "train.micro_batch_size=2", "train.seq_len=32"], tmp_path)
    got = measure_compute(cfg, CPU, torch.float32)
    config = model_config(cfg)
    for mode in ("none", "full", "selective"):
        assert got["layer_saved"][mode] == saved_activation_bytes_per_layer(config, 2, 32, 4, mode), mode
        assert got["layer_b"][mode] > 0 and got["layer_i"][mode] > 0
    h, v = config.hidden_size, config.vocab_size
    assert got["embed_params"] == v * h and got["head_params"] == h  # tied: the head adds only the final norm
    assert got["head_saved"] >= 2 * 32 * v * 4  # the logits at least
    assert got["boundary_bytes"] == 2 * 32 * h * 4 and got["param_bytes"] == 4
    assert min(got["layer_deferred"], got["layer_f"], got["layer_w"], got["head_f"], got["head_b"], got["optimizer_s_per_param"]) > 0
    assert got["layer_expert_params"] == 0


def test_a_moe_layer_counts_its_experts_apart(tmp_path):
    """What EP splits: every expert's three projections, not the router or attention."""
    cfg = compose_run_config(["model=tiny-moe", "model.num_experts=8", "train.micro_batch_size=1",
                              "train.seq_len=16"], tmp_path)
    got, config = measure_compute(cfg, CPU, torch.float32), model_config(cfg)
    assert got["layer_expert_params"] == 8 * 3 * config.hidden_size * config.moe_intermediate_size
    assert 0 < got["layer_expert_params"] < got["layer_params"]


def test_fit_is_least_squares_and_never_negative():
    fit = Fit.of([(0, 1.0), (10, 2.0), (20, 3.0)])
    assert fit.latency_s == pytest.approx(1.0) and fit.per_byte_s == pytest.approx(0.1)
    assert fit.time(30) == pytest.approx(4.0)
    assert Fit.of([(0, 1.0), (10, 0.5)]).per_byte_s == 0.0


def test_costs_cache_round_trips_per_key(tmp_path):
    cfg = compose_run_config(["model=tiny"], tmp_path)
    key = cost_key(cfg, "cpu", "float32", "gloo", 1)
    costs = MeasuredCosts(key=key, layer_f=1.0, layer_b={"none": 2.0}, layer_i={"none": 1.0}, layer_w=1.0,
                          embed_f=0.1, embed_b=0.2, embed_i=0.2, embed_w=0.0, head_f=0.5, head_b=1.0,
                          head_i=0.7, head_w=0.3, layer_saved={"none": 10}, layer_deferred=5, embed_saved=1,
                          embed_deferred=0, head_saved=20, head_deferred=9, layer_params=3, embed_params=4,
                          head_params=5, param_bytes=4, optimizer_s_per_param=1e-9, boundary_bytes=8,
                          p2p=Fit(1e-4, 1e-9), allreduce=Fit(2e-4, 2e-9))
    path = save(cfg, costs)
    assert path == cache_path(cfg, key) and path.parent == tmp_path / "costs"
    assert load_cached(cfg, key) == costs
    assert load_cached(cfg, cost_key(cfg, "cpu", "float32", "gloo", 2)) is None  # another thread count
    path.write_text("{broken")
    assert load_cached(cfg, key) is None


def test_profile_script_prints_the_table_and_caches(tmp_path, capsys):
    """scripts/profile_costs.py through its main(argv) in this process (a Python start-up fewer; its transport
    probe starts its own two processes all the same)."""
    args = ["model=tiny", "train.micro_batch_size=2", "train.seq_len=32", "train.dtype=fp32",
            f"data.cache_dir={tmp_path}", "--world-size=2"]
    spec = importlib.util.spec_from_file_location("profile_costs_script", ROOT / "scripts" / "profile_costs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    assert script.main(args) == 0
    assert torch.get_num_threads() == threads  # the profile restores this process's thread count
    stdout = capsys.readouterr().out
    assert "layer (recompute selective)" in stdout and "all-reduce (2 ranks)" in stdout
    cache = stdout.strip().splitlines()[-1].removeprefix("cache: ")
    assert cache.startswith(str(tmp_path / "costs" / "costs-")) and MeasuredCosts.from_json(open(cache).read())
