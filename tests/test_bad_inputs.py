"""Bad inputs end in exit 2 and one line naming the key or file and the fix (issue 35, item 9): a model.hf_config
config.json with values no model builds from, a run directory name over NAME_MAX, a chat template that fails in
scripts/generate.py, and a model that cannot fit this host's memory (the cost model's per-rank estimate, before
launch). Most cases run the pre-launch check in-process (`training.launch.cli.preflight`, what `python train.py` calls);
two go through train.py's entry point (`training.launch.cli.main`) in this process: they end before Hydra runs."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT
from tests.test_config_errors import train_py_here
from training.launch.cli import compose_validated, preflight
from training.config import register_schema
from training.launch.memory_fit import GIB, memory_problem, per_rank_bytes

LLAMA = json.loads((ROOT / "models" / "configs" / "llama-tiny" / "config.json").read_text())
GEMMA3 = json.loads((ROOT / "models" / "configs" / "gemma3-tiny" / "config.json").read_text())
MINIMIND = {"model_type": "minimind", "vocab_size": 2048, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
SEVEN_B = ["model.hidden_size=4096", "model.num_hidden_layers=32", "model.num_attention_heads=32",
           "model.num_key_value_heads=32", "model.intermediate_size=11008", "model.vocab_size=32000",
           "model.max_position_embeddings=4096", "model.tie_word_embeddings=false", "train.micro_batch_size=1",
           "train.seq_len=2048"]  # Llama-2 7B's shape
ROPE_TYPES = "use one of default, dynamic, linear, llama3, longrope"

BAD_HF_CONFIGS = [
    (LLAMA, {"vocab_size": -5}, "config.json's vocab_size=-5 must be a positive integer; fix it in config.json"),
    (LLAMA, {"num_attention_heads": 0}, "config.json's num_attention_heads=0 must be a positive integer"),
    (LLAMA, {"hidden_size": [64]}, "config.json's hidden_size=[64] must be a positive integer"),
    (LLAMA, {"hidden_size": "64"}, "config.json's hidden_size='64' must be a positive integer"),
    (LLAMA, {"intermediate_size": 64.5}, "config.json's intermediate_size=64.5 must be a positive integer"),
    (LLAMA, {"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4}},
     f"config.json's rope_parameters: rope_type 'bogus' is not one transformers implements; {ROPE_TYPES}"),
    (LLAMA, {"rope_scaling": {"type": "bogus", "factor": 2.0}}, "config.json's rope_scaling: rope_type 'bogus'"),
    (LLAMA, {"rope_parameters": "default"}, "config.json's rope_parameters='default' must be an object such as"),
    # Found by scripts/fuzz.py's soak: a rope_type that is not a string was a TypeError (unhashable) traceback.
    (MINIMIND, {"rope_parameters": {"type": []}}, "config.json's rope_parameters: rope_type [] is not one transformers "
                                                  "implements"),
    (LLAMA, {"hidden_act": "swishy"}, "config.json's hidden_act='swishy' is not an activation transformers knows; "
                                      "use one of gelu,"),
    (LLAMA, {"rms_norm_eps": -1e-6}, "config.json's rms_norm_eps=-1e-06 must be a finite number > 0"),
    (LLAMA, {"attention_bias": "no"}, "config.json's field 'attention_bias' expected bool, got str (value: 'no'); "
                                      "fix it in config.json"),  # transformers' own type check, in one line
    (GEMMA3, {"hidden_activation": "gelu_fancy"}, "config.json's hidden_activation='gelu_fancy' is not an "
                                                  "activation transformers knows"),
    (GEMMA3, {"rope_parameters": {**GEMMA3["rope_parameters"], "full_attention": {"rope_type": "yarnish"}}},
     "config.json's rope_parameters.full_attention: rope_type 'yarnish' is not one transformers implements"),
    (GEMMA3, {"sliding_window": 0}, "config.json's sliding_window=0 must be a positive integer"),
    (MINIMIND, {"vocab_size": -5}, "config.json's vocab_size=-5 must be a positive integer"),
    (MINIMIND, {"hidden_act": "gelu"}, "config.json's hidden_act='gelu': MiniMind's MLP runs silu only"),
]


@pytest.fixture(autouse=True)
def _schema(monkeypatch):
    register_schema()
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def run_preflight(args: list[str], capsys) -> tuple[int, list[str]]:
    """Exit code and stderr lines of the pre-launch check, as `python train.py args` runs it."""
    try:
        preflight(args)
        code = 0
    except SystemExit as leave:
        code = leave.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def config_folder(folder: Path, base: dict, changed: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**base, **changed}))
    return folder


@pytest.mark.parametrize("base, changed, expected", BAD_HF_CONFIGS,
                         ids=[f"{b['model_type']}-{json.dumps(c)}" for b, c, _ in BAD_HF_CONFIGS])
def test_bad_hf_config_value_is_one_line_before_launch(base, changed, expected, tmp_path, capsys):
    folder = config_folder(tmp_path / "hf", base, changed)
    code, lines = run_preflight(["model=llama-tiny", f"model.hf_config={folder}", f"hydra.run.dir={tmp_path}/run"],
                                capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"sluice: config error: model.hf_config={folder}: {expected}"), lines[0]


def test_config_json_that_is_no_object_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1, 2]")
    code, lines = run_preflight(["model=llama-tiny", f"model.hf_config={tmp_path}"], capsys)
    assert (code, lines) == (2, [f"sluice: config error: model.hf_config={tmp_path}: config.json holds list, not an "
                                 "object of fields"])


def test_zero_heads_through_train_py_exits_2_before_any_worker(tmp_path, monkeypatch, capsys):
    """train.py's pre-launch check, through its entry point in this process (it ends before Hydra runs)."""
    folder = config_folder(tmp_path / "hf", LLAMA, {"num_attention_heads": 0})
    result = train_py_here(["model=llama-tiny", f"model.hf_config={folder}", f"hydra.run.dir={tmp_path}/run"],
                           monkeypatch, capsys)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"sluice: config error: model.hf_config={folder}: config.json's num_attention_heads=0 must be a positive "
        "integer; fix it in config.json"]
    assert not (tmp_path / "run").exists()


def test_run_directory_name_over_name_max_is_one_line(tmp_path, monkeypatch, capsys):
    name = "r" * 300
    result = train_py_here(["model=tiny", f"hydra.run.dir={tmp_path}/{name}/run"], monkeypatch, capsys)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"sluice: config error: hydra.run.dir: the name {'r' * 20}... is 300 bytes, over the file system's limit of "
        "255 per file or folder name; choose a shorter hydra.run.dir"]


def test_checkpoint_dir_name_over_name_max_is_one_line(tmp_path, capsys):
    code, lines = run_preflight(["model=tiny", f"checkpoint.dir={tmp_path}/{'c' * 256}"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert "checkpoint.dir: the name cccccccccccccccccccc... is 256 bytes, over the file system's limit" in lines[0]


# scripts/generate.py

def generate_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("changed, expected", [
    ({"vocab_size": -5}, "vocab_size=-5 must be a positive integer; fix it in config.json"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer; fix it in config.json"),
    ({"rope_parameters": {"rope_type": "bogus"}}, f"rope_parameters: rope_type 'bogus' is not one transformers "
                                                  f"implements; {ROPE_TYPES}, proportional, yarn"),
])
def test_generate_on_a_folder_with_bad_values_is_one_line(changed, expected, tmp_path, capsys):
    folder = config_folder(tmp_path / "hf", LLAMA, changed)
    assert generate_script().main([str(folder), "the cat"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"generate: {folder}: its config.json's {expected}"]


@pytest.mark.parametrize("template, expected", [
    ("{{ raise_exception('only system turns') }}", "(TemplateError: only system turns)"),
    ("{% for m in messages %}{{ m['content'] }", "(TemplateSyntaxError: "),
])
def test_generate_chat_template_that_fails_is_one_line(template, expected, tmp_path):
    from training.data import synthetic_corpus, train_bpe_tokenizer

    generate = generate_script()
    tokenizer = train_bpe_tokenizer(synthetic_corpus(20, seed=0), vocab_size=300)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert generate.prompt_ids(tokenizer, "hi", True, "out/hf").shape[1] > 0  # a working template passes
    tokenizer.chat_template = template
    with pytest.raises(generate.InputError) as caught:
        generate.prompt_ids(tokenizer, "hi", True, "out/hf")
    message = str(caught.value)
    assert message.startswith(f"out/hf: its chat template fails on a user turn {expected}"), message
    assert message.endswith("; fix chat_template in the folder or drop --chat") and "\n" not in message


# The memory estimate before launch

def fake_host(monkeypatch, gib: float) -> None:
    """This host as one with `gib` GiB available (the check reads psutil's MemAvailable)."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=int(gib * GIB)))


def test_a_7b_model_on_a_24_gb_host_is_refused_with_the_figure(monkeypatch, tmp_path, capsys):
    fake_host(monkeypatch, 24)
    code, lines = run_preflight(["model=tiny", *SEVEN_B, f"hydra.run.dir={tmp_path}/run"], capsys)
    assert code == 2 and len(lines) == 1, lines
    need = max(per_rank_bytes(compose_validated(["model=tiny", *SEVEN_B]), None).values()) / GIB
    assert need > 6.7 * 16 * 1e9 / GIB  # at least weights, gradients and AdamW's two moments, 16 bytes each
    assert lines[0] == (
        f"sluice: config error: the model (model=tiny, 6.74B parameters) needs about {need:.1f} GiB per rank "
        "(weights, gradients, AdamW state, activations at train.micro_batch_size=1 x train.seq_len=2048) but this "
        "host has 24.0 GiB available; use a smaller model, more GPUs or hosts (parallel.tp/pp split the weights), "
        "parallel.zero=3 (with parallel.dp>=2: weights, gradients and AdamW state sharded over the DP ranks) or 1, "
        "train.recompute=full or a smaller train.micro_batch_size, or set "
        "parallel.memory_budget_gb (GiB per rank) where this figure is wrong")
    assert not (tmp_path / "run").exists()


def test_the_host_check_sums_the_ranks_it_launches(monkeypatch):
    cfg = compose_validated(["model=minimind3", "parallel.dp=2"])
    one = per_rank_bytes(cfg, None)
    assert sorted(one) == [0, 1] and one[0] == one[1]
    fake_host(monkeypatch, 1.5 * one[0] / GIB)  # room for one rank, not for two
    assert "but its 2 ranks need" in memory_problem(cfg)
    fake_host(monkeypatch, 2.5 * one[0] / GIB)
    assert memory_problem(cfg) is None


def test_under_torchrun_only_this_nodes_ranks_count(monkeypatch):
    cfg = compose_validated(["model=tiny", "parallel.pp=2", "parallel.dp=2"])
    everyone = per_rank_bytes(cfg, 4)
    assert everyone[0] == everyone[1] != everyone[2] == everyone[3]  # pipeline rank 0, then 1 (TP fastest, DP next)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert per_rank_bytes(cfg, 4) == {2: everyone[2], 3: everyone[3]}


def test_memory_budget_overrides_the_host_figure(monkeypatch):
    fake_host(monkeypatch, 1e6)
    cfg = compose_validated(["model=tiny", "parallel.memory_budget_gb=0.001"])
    assert "GiB per rank" in memory_problem(cfg) and "but parallel.memory_budget_gb=0.001; " in memory_problem(cfg)
    fake_host(monkeypatch, 0.001)  # the budget, not the host, is what counts when it is set
    assert memory_problem(compose_validated(["model=tiny", "parallel.memory_budget_gb=1"])) is None


def test_a_gpu_smaller_than_a_rank_is_named(monkeypatch):
    import torch

    import training.launch.memory_fit as memory_fit

    monkeypatch.setattr(memory_fit, "_on_gpu", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=24 * GIB))
    cfg = compose_validated(["model=tiny", *SEVEN_B])
    assert " but rank 0's GPU has 24.0 GiB; " in memory_problem(cfg)


def with_keys(cfg, **parallel):
    """A copy of `cfg` with these parallel.* values (as composing them would give)."""
    return OmegaConf.merge(cfg, {"parallel": parallel})


def test_a_refusal_at_dp_2_or_more_names_the_zero_level_that_fits():
    """At dp >= 2 the refusal prices the other parallel.zero levels of the same layout (a 7B model over dp=8, needing
    about 126 GiB per rank at zero=0) and names the lowest that fits the budget, with its figure."""
    cfg = compose_validated(["model=tiny", *SEVEN_B, "parallel.dp=8"])
    at = [max(per_rank_bytes(with_keys(cfg, zero=z), None).values()) / GIB for z in range(4)]
    assert at[0] > 90 > at[1] > 40 > at[3] > 20 and at[2] > 40
    for budget, named in [(90, f"parallel.zero=1 would need {at[1]:.1f} GiB per rank and fit, or "),  # the lowest
                          (40, f"parallel.zero=3 would need {at[3]:.1f} GiB per rank and fit, or "),
                          (20, f"parallel.zero=3 alone would still need {at[3]:.1f} GiB per rank; ")]:  # the closest
        assert memory_problem(with_keys(cfg, memory_budget_gb=budget)) == (
            f"the model (model=tiny, 6.74B parameters) needs about {at[0]:.1f} GiB per rank (weights, gradients, "
            "AdamW state, activations at train.micro_batch_size=1 x train.seq_len=2048) but "
            f"parallel.memory_budget_gb={budget}; {named}use a smaller model, more GPUs or hosts (parallel.tp/pp split "
            "the weights), train.recompute=full or a smaller train.micro_batch_size, or raise the budget")
    at_three = memory_problem(with_keys(cfg, zero=3, memory_budget_gb=20))
    assert "; use a smaller model" in at_three and "parallel.zero=" not in at_three  # no level does better than 3


def test_bf16_gathers_are_priced_and_offloaded_shards_are_checked_against_the_host(monkeypatch):
    import torch

    import training.launch.memory_fit as memory_fit

    cfg = compose_validated(["model=tiny", *SEVEN_B, "parallel.dp=2", "parallel.zero=2"])
    fp32, bf16 = (per_rank_bytes(with_keys(cfg, mixed_precision_param=d), None)[0] for d in ("fp32", "bf16"))
    assert fp32 - bf16 == pytest.approx(2 * 6.74e9, rel=1e-3)  # the gathered weights at 2 bytes, not 4
    monkeypatch.setattr(memory_fit, "_on_gpu", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * GIB))
    whole = per_rank_bytes(with_keys(cfg, zero=3), None)
    offload = with_keys(cfg, zero=3, cpu_offload=True)  # validate needs a CUDA build for it: merged, not composed
    device, host = per_rank_bytes(offload, None), per_rank_bytes(offload, None, host=True)
    assert host[0] == host[1] == pytest.approx(16 * 6.74e9 / 2, rel=1e-3)  # the shards, their gradients, AdamW
    assert device[0] + host[0] == pytest.approx(whole[0], abs=8)  # moved off the GPU, not lost
    fake_host(monkeypatch, 24)
    assert memory_problem(offload).split("; ")[0].endswith(
        f"but its ranks pin {2 * host[0] / GIB:.1f} GiB of host memory (parallel.cpu_offload=true) and this host has "
        "24.0 GiB available")
    fake_host(monkeypatch, 2.5 * host[0] / GIB)
    assert memory_problem(offload) is None


def test_a_normal_tiny_run_is_not_refused(capsys):
    code, lines = run_preflight(["model=tiny"], capsys)  # on this host, with its real memory
    assert (code, lines) == (0, [])
    peak = per_rank_bytes(compose_validated(["model=tiny"]), None)[0]
    assert 0 < peak < GIB // 4


def test_a_sweep_launched_on_other_hosts_is_not_judged_by_this_one(monkeypatch, tmp_path, capsys):
    fake_host(monkeypatch, 24)
    sweep = ["-m", "hydra/launcher=slurm", "model=tiny", *SEVEN_B, "optim.lr=1e-3,2e-3",
             f"hydra.sweep.dir={tmp_path}/s"]
    assert run_preflight(sweep, capsys) == (0, [])
    code, lines = run_preflight([*sweep, "parallel.memory_budget_gb=24"], capsys)  # a budget still applies
    assert code == 2 and "but parallel.memory_budget_gb=24; " in lines[0]


def test_the_estimate_equals_the_cost_model_fed_with_measured_costs():
    """The figure before launch is the cost model's per-rank peak: for MiniMind (a closed activation formula) its
    counted inputs give the peaks the measured ones give, within 5% (the head's saved bytes are a formula)."""
    import torch

    from training.launch.memory_fit import estimated_costs
    from training.layout_search.costs import Fit, MeasuredCosts
    from training.layout_search.predict import candidate_of, predict
    from training.layout_search.profile import measure_compute

    cfg = compose_validated(["model=tiny", "train.seq_len=64", "train.micro_batch_size=2", "train.dtype=fp32",
                             "parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=4"])
    measured = MeasuredCosts(key={"micro_batch_size": 2, "backend": "gloo"}, p2p=Fit(0, 0), allreduce=Fit(0, 0),
                             **measure_compute(cfg, torch.device("cpu"), torch.float32))
    expected = predict(candidate_of(cfg), cfg, measured).peak_bytes
    estimate = predict(candidate_of(cfg), cfg, estimated_costs(cfg)).peak_bytes
    assert all(abs(e / m - 1) < 0.05 for e, m in zip(estimate, expected)), (estimate, expected)
    assert per_rank_bytes(cfg, None) == {0: estimate[0], 1: estimate[1]}
