"""The validation catalogue, table-driven: every bad config exits 2 with one line naming the key, before launch.

The table runs in-process through `training.launch.cli.preflight` (the exact function `python train.py` calls before
Hydra starts anything): a `python train.py` subprocess costs ~10 s of imports on 2 cores, so only a
representative subset runs end to end (tests/test_config_errors.py)."""

import json

import pytest
from omegaconf import OmegaConf

from parallel.pipeline.schedules import SCHEDULES
from training.launch.cli import preflight
from training.config import ConfigError, register_schema
from training.reliability.faults import parse_fault
from training.config.layout import layout_world_size, process_pp
from training.config.run_model import nearest_key

TINY = ["model=tiny"]
PP2 = ["model=tiny", "parallel.pp=2"]

# (overrides, text the one line must contain: the key and what is wrong). `{tmp}` is a fresh temporary folder.
BAD = [
    # model
    (["model=nope"], "model=nope: no such preset"),
    (["model.vocab_size=0"], "model.vocab_size=0 must be positive"),
    (["model.hidden_size=-64"], "model.hidden_size=-64 must be positive"),
    (["model.intermediate_size=0"], "model.intermediate_size=0 must be positive"),
    (["model.num_hidden_layers=0"], "model.num_hidden_layers=0 must be positive"),
    (["model.num_attention_heads=0"], "model.num_attention_heads=0 must be positive"),
    (["model.num_key_value_heads=0"], "model.num_key_value_heads=0 must be positive"),
    (["model.max_position_embeddings=0"], "model.max_position_embeddings=0 must be positive"),
    (["model.rms_norm_eps=0"], "model.rms_norm_eps=0.0 must be positive"),
    (["model.rope_theta=-1"], "model.rope_theta=-1.0 must be positive"),
    (["model.rope_theta=inf"], "model.rope_theta=inf must be a finite number > 0"),
    (["model.dropout=1"], "model.dropout=1.0 must lie in [0, 1)"),
    (["model.dropout=-0.1"], "model.dropout=-0.1 must lie in [0, 1)"),
    (["model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef=-1.0 must be a finite number >= 0"),
    (["model.initializer_range=0"], "model.initializer_range=0.0 must be positive"),
    (["model.num_experts=0"], "model.num_experts=0 must be positive"),
    (["model.num_experts=8"], "model.num_experts=8 is read only when model.use_moe=True"),
    (["model.use_moe=maybe"], "model.use_moe: Value 'maybe' is not a valid bool"),
    (["~model.use_moe"], "model.use_moe: deleting a key is not supported; set it instead"),
    (["~model.hidden_size"], "model.hidden_size: deleting a key is not supported; set it instead"),
    (["model.head_dim=16"], "model.head_dim: unknown config key; did you mean model.hidden_size?"),
    ([*TINY, "model.num_key_value_heads=3"], "model.num_key_value_heads=3 must divide"),
    ([*TINY, "model.hidden_size=66"], "model.hidden_size=66 is not divisible by model.num_attention_heads=4"),
    ([*TINY, "model.hidden_size=12"], "head_dim=3 is odd"),
    (["model=tiny-moe", "model.num_experts_per_tok=5"], "model.num_experts_per_tok=5 exceeds model.num_experts=4"),
    # parallel
    (["parallel.tp=0"], "parallel.tp=0 must be positive"),
    (["parallel.pp=0"], "parallel.pp=0 must be positive"),
    (["parallel.vpp=0"], "parallel.vpp=0 must be positive"),
    (["parallel.dp=0"], "parallel.dp=0 must be positive"),
    (["parallel.backend=mpi"], "parallel.backend=mpi is not supported; use one of auto, gloo, nccl"),
    (["parallel.timeout_s=inf"], "parallel.timeout_s=inf must be a finite number > 0"),
    (["parallel.timeout_s=0"], "parallel.timeout_s=0.0 must be positive"),
    (["parallel.zero=2"], "parallel.zero=2 shards over the data-parallel ranks and this layout has one (dp=1): "
                            "nothing to shard"),
    (["parallel.zero=4"], "parallel.zero=4 is not supported; use one of 0, 1, 2, 3"),
    (["parallel.dp_replicate=2"], "parallel.dp_replicate=2 is read only when parallel.zero=2|3 (here parallel.zero=0)"),
    (["parallel.zero=1", "parallel.mixed_precision_param=bf16"], "parallel.mixed_precision_param=bf16 is read only "
                                                                 "when parallel.zero=2|3 (here parallel.zero=1)"),
    (["parallel.mixed_precision_param=fp16"], "parallel.mixed_precision_param=fp16 is not supported; use one of fp32, "
                                              "bf16"),
    (["parallel.cpu_offload=true"], "parallel.cpu_offload=True is read only when parallel.zero=2|3"),
    (["parallel.dp=2", "parallel.zero=3", "parallel.backend=gloo", "parallel.cpu_offload=true"],
     "parallel.cpu_offload=true needs CUDA (shards in CPU memory, gathered to the GPU that computes), but "
     "parallel.backend=gloo computes on the CPU here"),
    (["parallel.bucket_mb=0"], "parallel.bucket_mb=0.0 must be positive"),
    (["parallel.transport=tcp"], "parallel.transport=tcp is not supported; use one of auto, shm, p2p"),
    (["parallel.layout=manual"], "parallel.layout=manual is not supported; use one of auto"),
    (["parallel.plan=auto"], "parallel.plan: renamed to parallel.layout (e.g. parallel.layout=auto)"),
    (["parallel.memory_budget_gb=-1"], "parallel.memory_budget_gb=-1.0 must be positive"),
    (["parallel.vpp=2"], "parallel.vpp=2 needs a pipeline; set parallel.pp>=2"),
    ([*PP2, "parallel.vpp=2"], "schedule '1f1b' runs 1 stage per rank; set parallel.vpp=1 (got 2)"),
    ([*PP2, "schedule=interleaved-1f1b"], "schedule 'interleaved-1f1b' runs 2 or more stages per rank; set "
                                          "parallel.vpp>=2 (got 1)"),
    ([*TINY, "parallel.tp=3"], "parallel.tp=3 does not divide num_attention_heads=4; choose tp in {1, 2}"),
    ([*TINY, "parallel.pp=5"], "5 stages but the model has 4 layers; use at most 4 stages"),
    ([*TINY, "parallel.pp=3", "parallel.layers_per_stage=[1,3,1]"], "sums to 5 but the model has 4 layers"),
    ([*PP2, "parallel.layers_per_stage=[4,0]"], "parallel.layers_per_stage[1] = 0"),
    ([*PP2, "parallel.layers_per_stage=[1.5,2]"], "parallel.layers_per_stage[0] = 1.5 is not an integer layer count"),
    ([*PP2, "parallel.layers_per_stage=even"], "parallel.layers_per_stage=even: give one layer count per stage"),
    (["parallel.tensor=2"], "parallel.tensor: unknown config key; did you mean parallel."),
    # schedule
    (["schedule=zigzag"], "schedule=zigzag: no such preset"),
    (["schedule.name=zigzag"], f"schedule.name=zigzag is not supported; use one of {', '.join(sorted(SCHEDULES))}"),
    (["schedule.n_microbatches=0"], "schedule.n_microbatches=0 must be positive"),
    ([*PP2, "schedule.n_microbatches=0"], "schedule.n_microbatches=0 must be positive"),
    (["schedule.path=my.csv"], "schedule.path=my.csv is read only when schedule.name=table"),
    ([*PP2, "schedule=table"], "schedule=table needs schedule.path="),
    ([*PP2, "schedule=module"], "schedule=module needs schedule.module=<package.module:function>"),
    (["schedule.module=a.b:c"], "schedule.module=a.b:c is read only when schedule.name=module"),
    ([*PP2, "schedule=module", "schedule.module=no_such_package:f"], "schedule.module=no_such_package:f: cannot "
                                                                     "load it (No module named 'no_such_package')"),
    ([*PP2, "schedule=module", "schedule.module=tests.late_w_schedule:one_f_one_b_late_w", "parallel.vpp=2"],
     "schedule 'tests.late_w_schedule:one_f_one_b_late_w' runs 1 stage per rank; set parallel.vpp=1 (got 2)"),
    # train
    (["train.steps=0"], "train.steps=0 must be positive"),
    (["train.steps=many"], "train.steps: Value 'many' of type 'str' could not be converted to Integer"),
    (["train.micro_batch_size=-2"], "train.micro_batch_size=-2 must be positive"),
    (["train.seq_len=1"], "train.seq_len=1 must be >= 2"),
    ([*TINY, "train.seq_len=4096"], "train.seq_len=4096 exceeds model.max_position_embeddings"),
    (["train.seed=-1"], "train.seed=-1 must be >= 0"),
    (["train.dtype=fp8"], "train.dtype=fp8 is not supported"),
    (["train.grad_clip=-1"], "train.grad_clip=-1.0 must be a finite number >= 0"),
    (["train.log_every=0"], "train.log_every=0 must be positive"),
    (["train.trace_step=0"], "train.trace_step=0 must be positive"),
    (["train.steps=10", "train.trace_step=11"], "train.trace_step=11 is after the last step (train.steps=10)"),
    (["train.recompute=some"], "train.recompute=some is not supported; use one of none, full, selective"),
    (["train.eval_every=-1"], "train.eval_every=-1 must be a finite number >= 0"),
    (["train.eval_batches=0"], "train.eval_batches=0 must be positive"),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite=ignore is not supported; use one of stop, skip"),
    (["train.max_skipped_steps=0"], "train.max_skipped_steps=0 must be positive"),
    (["train.global_batch_size=0"], "train.global_batch_size=0 must be positive"),
    (["train.global_batch_size=20"], "train.global_batch_size=20 is not a multiple of dp 1 x "
                                     "train.micro_batch_size 8 = 8; change one of them"),
    (["parallel.dp=2", "train.global_batch_size=24"], "train.global_batch_size=24 is not a multiple of dp 2 x "
                                                      "train.micro_batch_size 8 = 16"),
    (["train.peak_tflops=0"], "train.peak_tflops=0.0 must be positive"),
    (["train.stpes=5"], "train.stpes: unknown config key; did you mean train.steps?"),
    (["+train.eval_evry=10"], "train.eval_evry: unknown config key; did you mean train.eval_every?"),
    (["+train.activation_checkpointing=true"], "did you mean train.recompute?"),
    # optim
    (["optim.name=sgd"], "optim.name=sgd is not supported; use one of adamw"),
    (["optim.lr=0"], "optim.lr=0.0 must be positive"),
    (["optim.lr=inf"], "optim.lr=inf must be a finite number > 0"),
    (["optim.lr=nan"], "optim.lr=nan must be a finite number > 0"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must lie in [0, 1]"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be a finite number >= 0"),
    (["optim.betas=[0.9]"], "optim.betas=[0.9] must be two numbers in [0, 1)"),
    (["optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    (["optim.eps=0"], "optim.eps=0.0 must be positive"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1 must be a finite number >= 0"),
    # data
    (["data=jsonl"], "data.path: not set; pass data.path="),
    (["data=jsonl", "data.path=no/such/file.jsonl", "data.tokenizer=no/such/dir"], "data.path"),
    (["data=hf"], "data=hf: no such preset"),
    (["data.name=hf"], "data.name=hf is not supported; use one of synthetic, jsonl"),
    (["data.format=zip"], "data.format=zip is not supported; use one of packed, padded, chat"),
    (["data.num_docs=0"], "data.num_docs=0 must be positive"),
    (["data.vocab_size=100"], "data.vocab_size=100 must be >= 259"),
    (["data.seed=-1"], "data.seed=-1 must be >= 0"),
    (["data.cache_dir=''"], "data.cache_dir is empty"),
    (["data.val_fraction=1"], "data.val_fraction=1.0 must lie in [0, 1)"),
    (["data.format=chatty"], "data.format=chatty"),
    (["data.val_path={tmp}/missing.jsonl"], "data.val_path"),
    (["data.max_line_bytes=0"], "data.max_line_bytes=0 must be positive"),
    (["data.path=x.jsonl"], "data.path=x.jsonl is read only when data.name=jsonl"),
    ([*TINY, "model.vocab_size=100"], "model.vocab_size=100"),
    # checkpoint
    (["checkpoint.load_dense=no/such.pth"], "checkpoint.load_dense=no/such.pth does not exist"),
    (["checkpoint.every=-1"], "checkpoint.every=-1 must be a finite number >= 0"),
    (["checkpoint.resume=no/such/dir"], "checkpoint.resume=no/such/dir does not exist"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last=0 must be positive"),
    # logger
    (["logger=nope"], "logger=nope: no such preset"),
    (["logger.mode=bogus"], "logger.mode=bogus is not supported; use one of offline, online, disabled"),
    (["logger.backends=[mlflow]"], "logger.backends=['mlflow']: unknown logger 'mlflow'"),
    (["logger.backends=[none,wandb]"], "logger.backends=['none', 'wandb'] repeats a logger or mixes none"),
    (["logger.project=''"], "logger.project is empty"),
    (["logger.name=mlflow"], "logger.name=mlflow is not supported"),
    (["train.max_skipped_steps=5"], "train.max_skipped_steps=5 is read only when train.on_nonfinite=skip"),
    # debug
    (["debug.fault='boom@rank=1,step=2'"], "debug.fault=boom@rank=1,step=2: unknown fault 'boom'"),
    (["debug.fault='nan@rank=-1,step=2'"], "debug.fault=nan@rank=-1,step=2: rank must be >= 0"),
    (["debug.fault='crash@rank=0'"], "debug.fault=crash@rank=0: rank= and step= are both required"),
    (["debug.fault='stall@rank=1,step=2,action=X9'"], "debug.fault=stall@rank=1,step=2,action=X9: action:"),
    (["debug.fault='stall@rank=1,step=-1'"], "debug.fault=stall@rank=1,step=-1: rank must be >= 0 and step >= 0"),
    # the whole config: unknown sections, interpolations, output directories
    (["+foo=1"], "foo: unknown config key; did you mean"),
    (["train.steps=${nope}"], "train.steps: cannot resolve its interpolation"),
    (["hydra.run.dir={tmp}/file/run"], "hydra.run.dir={tmp}/file/run cannot be created: {tmp}/file is a file"),
    (["-m", "hydra.sweep.dir={tmp}/file", "train.steps=1,2"], "hydra.sweep.dir={tmp}/file is a file, not a folder"),
    (["checkpoint.dir={tmp}/file"], "checkpoint.dir={tmp}/file is a file, not a folder; choose another checkpoint.dir"),
    (["checkpoint.dir={tmp}/file/ckpt"], "checkpoint.dir={tmp}/file/ckpt cannot be created: {tmp}/file is a file"),
    (["data.cache_dir={tmp}/file/cache"], "data.cache_dir={tmp}/file/cache cannot be created: {tmp}/file is a file"),
    (["-m", "train.steps=1,0"], "train.steps=0 must be positive"),
    # MiniMind's `--flag value` arguments: the override that means the same (docs/configuration.md#from-minimind)
    (["--epochs", "2"], "--epochs 2 is MiniMind's argument; train.py takes key=value overrides: train.epochs=2 (the steps"),
    (["model=tiny", "--batch_size", "32"], "--batch_size 32 is MiniMind's argument; train.py takes key=value "
                                           "overrides: train.micro_batch_size=32"),
    (["--learning_rate=5e-4"], "--learning_rate=5e-4 is MiniMind's argument; train.py takes key=value overrides: "
                               "optim.lr=5e-4"),
    (["--from_weight", "pretrain"], "checkpoint.load_dense=<the weights file or folder, e.g. pretrain_768.pth>"),
    (["--steps", "5"], "--steps 5: train.py has no option --steps; it takes key=value overrides"),
]


@pytest.fixture(autouse=True)
def _schema(monkeypatch):
    register_schema()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def run_preflight(args: list[str], capsys) -> tuple[int, list[str]]:
    """Exit code and stderr lines of the pre-launch check, as `python train.py args` would run it."""
    try:
        preflight(args)
        code = 0
    except SystemExit as leave:
        code = leave.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_the_table_is_large_and_covers_every_group():
    assert len(BAD) >= 60
    touched = {arg.lstrip("+").split(".")[0].split("=")[0] for args, _ in BAD for arg in args if not arg.startswith("-")}
    assert {"model", "parallel", "schedule", "train", "optim", "data", "checkpoint", "logger", "debug", "hydra"} <= touched


@pytest.mark.parametrize("args, expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_config_is_one_line_exit_2(args, expected, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    code, lines = run_preflight(args, capsys)
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("sluice: config error: ")
    assert expected.replace("{tmp}", str(tmp_path)) in lines[0]


def test_good_configs_pass(capsys):
    for args in ([], ["experiment=demo"], [*PP2, "parallel.vpp=2", "schedule=interleaved-1f1b"],
                 [*PP2, "schedule=module", "schedule.module=tests.late_w_schedule:one_f_one_b_late_w"],
                 ["model=tiny-moe", "model.num_experts=8"], ["logger=wandb"],
                 ["parallel.zero=1", "parallel.bucket_mb=50", "train.recompute=full"], ["-m", "train.steps=100,200"],
                 ["-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=5", "hydra.launcher.partition=gpu",
                  "train.steps=100,200"]):  # a launcher's keys come with its choice, never swept
        assert run_preflight(args, capsys) == (0, []), args


def test_warmup_longer_than_the_run_warns_and_runs(capsys):
    code, lines = run_preflight(["train.steps=5"], capsys)
    assert code == 0
    assert lines == ["sluice: config warning: optim.warmup_steps=100 is longer than the run (train.steps=5): "
                     "the learning rate never reaches optim.lr"]


def test_world_size_rule():
    cfg = OmegaConf.create({"parallel": {"dp": None, "tp": 2, "pp": 2, "emulate": False}})
    assert layout_world_size(cfg) == 4 and layout_world_size(cfg, 8) == 8
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of parallel.tp\\*pp = 2\\*2"):
        layout_world_size(cfg, 6)
    cfg.parallel.dp = 3
    with pytest.raises(ConfigError, match="world size 8 != parallel.dp\\*tp\\*pp = 3\\*2\\*2"):
        layout_world_size(cfg, 8)
    cfg.parallel.emulate = True
    assert process_pp(cfg) == 1 and layout_world_size(cfg) == 6


def test_fault_setting_parses():
    spec = parse_fault("stall@rank=1,step=3,action=F2@s1")
    assert (spec.kind, spec.rank, spec.step, str(spec.action)) == ("stall", 1, 3, "F2@s1")
    assert parse_fault("nan@step=4,rank=0").action is None


def test_nearest_key():
    assert nearest_key("train.stpes") == "train.steps"
    assert nearest_key("learning_rate") == "optim.lr"


def test_validation_writes_nothing(tmp_path, capsys):
    """The synthetic tokenizer is never trained by the check: its cache folder does not even appear."""
    assert run_preflight(["model=tiny", f"data.cache_dir={tmp_path}/cache", f"hydra.run.dir={tmp_path}/run"],
                         capsys) == (0, [])
    assert list(tmp_path.iterdir()) == []


def write_tokenizer(folder, vocab: dict[str, int], added: list[tuple[str, int]], config: dict | None = None):
    folder.mkdir()
    spec = {"model": {"type": "BPE", "vocab": vocab, "merges": []},
            "added_tokens": [{"id": i, "content": c, "special": True} for c, i in added]}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_synthetic_only_key_under_jsonl_warns(tmp_path, capsys):
    write_tokenizer(tmp_path / "tok", {chr(97 + i): i for i in range(10)}, [])
    (tmp_path / "data.jsonl").write_text('{"text": "hello world, again and again"}\n' * 2000)
    code, lines = run_preflight(["model=tiny", "data=jsonl", f"data.path={tmp_path}/data.jsonl",
                                 f"data.tokenizer={tmp_path}/tok", "data.num_docs=300"], capsys)
    assert code == 0
    assert lines == ["sluice: config warning: data.num_docs=300 is read only when data.name=synthetic "
                     "(here data.name=jsonl); it is ignored"]


def test_memory_budget_without_the_layout_search_bounds_the_fixed_layout(capsys):
    code, lines = run_preflight(["model=tiny", "parallel.memory_budget_gb=40"], capsys)
    assert code == 0 and lines == []  # read by the launch's memory check (tests/test_bad_inputs.py refuses)


def test_corrupt_tokenizer_through_preflight(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(b"\xff\xfe garbage")
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    code, lines = run_preflight(["data=jsonl", f"data.path={tmp_path}/data.jsonl", f"data.tokenizer={tmp_path}/tok"],
                                capsys)
    assert code == 2 and len(lines) == 1
    assert f"{tmp_path}/tok/tokenizer.json' is corrupt" in lines[0]



@pytest.mark.parametrize("args, warning", [
    (["data.val_fraction=0.1"], "data.val_fraction=0.1 holds data out of training, but train.eval_every=0 never "
                                "evaluates it"),
    (["train.trace_step=3"], "train.trace_step=3 traces the pipeline schedule, and parallel.pp=1 has none"),
])
def test_a_setting_that_would_do_nothing_warns(args, warning, capsys):
    code, lines = run_preflight(["optim.warmup_steps=0", *args], capsys)
    assert code == 0 and len(lines) == 1 and lines[0].startswith(f"sluice: config warning: {warning}"), lines
