"""LoRA: adapters on the decoder layers' linears, the base frozen; equal to one process at tp2 x pp2 1F1B and
dp2 x pp2 ZB-H1 on a dense and an MoE model, only adapters in the optimizer and the DP buckets, a bit-for-bit
resume, merged and PEFT exports whose logits are the trained model's, and the pre-launch checks."""

import json
from pathlib import Path

import pytest
import torch

from checkpoint.adapters import CONFIG, PEFT_PREFIX, WEIGHTS
from checkpoint.dense import CheckpointError
from checkpoint.export import export_checkpoint, read_training_weights
from checkpoint.lora_merge import is_adapter, merge_adapters
from minimind import MiniMindForCausalLM
from models import build_model, decoder_of
from parallel.grid import ParallelGrid
from tests.equivalence import (assert_bitwise_resume, assert_equivalent, baseline, compose_run_config,
                               dense_params, layouts_worker)
from tests.shared import once_per_session
from tests.spawn import run_workers
from training.config import model_config
from training.methods.lora import LoraSpec, apply_lora, lora_targets, matches
from training.specs import lora_spec

pytestmark = pytest.mark.timeout(1200)  # the module's shared spawn runs inside its first test

CPU = torch.device("cpu")
STEPS = ["train.steps=3"]
DENSE = ["model=tiny", "lora=minimind", "lora.rank=8"]  # rank 8 on the square linears: q_proj (colwise), o_proj
# Rank 4, scale 4, on attention, the router (a whole linear under TP) and the experts' colwise and rowwise linears.
MOE = ["model=tiny-moe", "lora.rank=4", "lora.alpha=16",
       "lora.targets=[q_proj,o_proj,mlp.gate,experts.*.up_proj,experts.*.down_proj]"]
# Both layouts step over the same 4 micro-batches as the single process (tp2 x pp2: 4 per step; dp2: 2 per replica).
LAYOUTS = {"tp2-pp2-1f1b": ["parallel.tp=2", "parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=4"],
           "dp2-pp2-zb-h1": ["parallel.dp=2", "parallel.pp=2", "schedule=zb-h1", "schedule.n_microbatches=2"]}
SAVED = ["checkpoint.every=2", "checkpoint.save_final=true"]  # dense tp2 x pp2 keeps steps 2 (resumed) and 3
CASES = [(model, layout) for model in ("dense", "moe") for layout in LAYOUTS]


def model_args(model: str, root: Path) -> list[str]:
    """The model's overrides; the dense one starts from a .pth (its base weights load as dense global keys)."""
    return [*DENSE, f"checkpoint.load_dense={root / 'dense.pth'}"] if model == "dense" else list(MOE)


def run_args(model: str, layout: str, root: Path) -> list[str]:
    saved = SAVED if (model, layout) == ("dense", "tp2-pp2-1f1b") else []
    return [*STEPS, *model_args(model, root), *LAYOUTS[layout], *saved]


def inspect_worker(rank: int, world_size: int, overrides: list[str], cache_dir: str, run_dir: str) -> dict:
    """One step of a built trainer: the names its optimizer and its DP buckets hold, and which parameters got a
    gradient, against the adapters and all the parameters this rank holds."""
    from training.trainer import Trainer

    cfg = compose_run_config(overrides, Path(cache_dir))
    p = cfg.parallel
    trainer = Trainer(cfg, ParallelGrid.build(p.dp, p.tp, p.pp, backend="gloo", timeout_s=120), Path(run_dir))
    named = trainer.engine.named_parameters()
    name_of = {id(param): name for name, param in named.items()}
    optimized = {name_of[id(q)] for group in trainer.optimizer.param_groups for q in group["params"]}
    bucketed = {name_of[id(q)] for bucket in trainer.engine.sync.order for q in bucket.params}
    trainer.engine.step(next(iter(trainer.data)))
    return {"all": sorted(named), "adapters": sorted(n for n in named if is_adapter(n)), "optimized": sorted(optimized),
            "bucketed": sorted(bucketed), "with_grad": sorted(n for n, q in named.items() if q.grad is not None)}


def layouts_then_inspect(rank: int, world_size: int, jobs: list, inspect: list[str], cache_dir: str,
                         run_dir: str) -> tuple[list[dict], dict]:
    """The layouts, then the inspection, on one spawn's processes."""
    return layouts_worker(rank, world_size, jobs, cache_dir), inspect_worker(rank, world_size, inspect, cache_dir,
                                                                             run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The four layouts and a resumed run in one spawn of 4 processes, an inspection on the same processes; the
    single-process references in this one (computed once per session)."""

    def compute(root: Path) -> dict:
        cache = root / "cache"
        torch.manual_seed(7)  # base weights unlike the seeded init: loading them visibly replaces it
        dense = compose_run_config(["model=tiny"], cache)
        torch.save(MiniMindForCausalLM(model_config(dense)).state_dict(), root / "dense.pth")
        jobs = [(run_args(m, layout, root), str(root / f"{m}-{layout}")) for m, layout in CASES]
        resume_from = root / "dense-tp2-pp2-1f1b" / "checkpoints" / "step_00000002"
        jobs.append(([*run_args("dense", "tp2-pp2-1f1b", root), f"checkpoint.resume={resume_from}"],
                     str(root / "resumed")))
        inspected = ("moe", "dp2-pp2-zb-h1")
        by_rank = run_workers(layouts_then_inspect, 4, jobs, [*run_args(*inspected, root), "train.steps=1"],
                              str(cache), str(root / "inspect"), timeout=900)
        out = {case: [r[0][i] for r in by_rank] for i, case in enumerate(CASES)}
        out["resumed"] = [r[0][len(CASES)] for r in by_rank]
        out["inspected"] = {inspected: [r[1] for r in by_rank]}
        out["reference"] = {m: baseline([*STEPS, *model_args(m, root), "schedule.n_microbatches=4"], cache,
                                        root / f"baseline-{m}", 1) for m in ("dense", "moe")}
        out["root"] = str(root)
        return out

    return once_per_session(tmp_path_factory, "lora", compute)


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{layout}" for m, layout in CASES])
def test_layout_equals_one_process(runs, case):
    """Losses, grad norms, step-1 gradients and final parameters (adapters and frozen base) equal one process's."""
    reference = runs["reference"][case[0]]
    assert_equivalent(runs[case], reference)
    adapters = {name for name in reference["params"] if is_adapter(name)}
    assert adapters and all(reference["grads"][name][0].abs().sum() == 0 for name in reference["params"]
                            if name not in adapters), "a frozen weight took a gradient"
    assert any(reference["grads"][name][0].abs().sum() > 0 for name in adapters)


def test_base_weights_stay_the_loaded_ones(runs):
    """The frozen base of the dense runs is still the .pth it loaded, bit for bit, after three steps."""
    loaded = torch.load(Path(runs["root"]) / "dense.pth", weights_only=True)
    for layout in LAYOUTS:
        final = dense_params(runs["dense", layout])
        assert {n for n in final if not is_adapter(n)} == set(loaded) - {"lm_head.weight"}
        for name, tensor in final.items():
            if not is_adapter(name):
                assert torch.equal(tensor, loaded[name]), f"{layout}: {name} moved"


def test_only_adapters_are_optimized_bucketed_and_get_gradients(runs):
    """MoE at dp2 x pp2 ZB-H1 (an adapter on every expert's up and down projections, the router and attention)."""
    for rank in runs["inspected"]["moe", "dp2-pp2-zb-h1"]:
        assert rank["adapters"] and len(rank["adapters"]) < len(rank["all"])
        assert rank["optimized"] == rank["adapters"]
        assert rank["with_grad"] == rank["adapters"]
        assert rank["bucketed"] == rank["adapters"]  # every adapter is summed over DP, nothing else


def test_resume_is_bit_for_bit(runs):
    straight = runs["dense", "tp2-pp2-1f1b"]
    assert_bitwise_resume(straight, runs["resumed"], start=2)


def trained_model(params: dict[str, torch.Tensor], overrides: list[str], cache: Path) -> torch.nn.Module:
    """One process's model with the run's adapters, holding a run's final parameters."""
    cfg = compose_run_config(overrides, cache)
    decoder = decoder_of(build_model(model_config(cfg), "cpu"))
    apply_lora(decoder, lora_spec(cfg), ParallelGrid.single(CPU))
    missing, unexpected = decoder.module.load_state_dict(params, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the tied head folds into the embedding
    return decoder.module.eval()


def test_exports_give_the_trained_model_logits(runs, tmp_path):
    """The merged folder and the PEFT adapters on the base weights both compute the trained model's logits."""
    root = Path(runs["root"])
    final = dense_params(runs["dense", "tp2-pp2-1f1b"])
    checkpoint = root / "dense-tp2-pp2-1f1b" / "checkpoints" / "step_00000003"
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained_model(final, run_args("dense", "tp2-pp2-1f1b", root), root / "cache")(ids).logits

        merged = MiniMindForCausalLM.from_pretrained(str(export_checkpoint(checkpoint, tmp_path / "merged",
                                                                           "minimind"))).eval()
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=2e-5)

        from tests.test_scripts import script

        folder = tmp_path / "adapters"
        assert script("export_hf").main([str(checkpoint), str(folder), "--adapters-only"]) == 0  # as a user runs it
        assert sorted(p.name for p in folder.iterdir()) == [CONFIG, WEIGHTS]
        config = json.loads((folder / CONFIG).read_text())
        square = [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("o_proj", "q_proj")]
        assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias",
                                       "target_modules")} == {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 8, "lora_dropout": 0.0,
            "bias": "none", "target_modules": sorted(square)}
        from safetensors.torch import load_file

        stored = load_file(folder / WEIGHTS)
        assert set(stored) == {PEFT_PREFIX + n for n in final if is_adapter(n)}
        import peft  # requirements.txt installs it

        base = MiniMindForCausalLM(model_config(compose_run_config(["model=tiny"], root / "cache")))
        base.load_state_dict({n: t for n, t in final.items() if not is_adapter(n)}, strict=False)
        loaded = peft.PeftModel.from_pretrained(base.eval(), str(folder)).eval()
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=2e-5)


def test_export_refuses_adapters_only_without_lora(runs, tmp_path):
    state, meta = read_training_weights(Path(runs["root"]) / "dense-tp2-pp2-1f1b")
    assert "lora" in meta and meta["lora"]["rank"] == 8
    from checkpoint.manager import lora_mismatch

    assert lora_mismatch(Path("c"), meta["lora"], None) == (
        "checkpoint c was written with lora.rank=8 but this run has lora.rank=0; use the checkpoint's lora "
        "settings or checkpoint.resume=none")
    with pytest.raises(CheckpointError, match=r"--adapters-only --format minimind: adapters go out as a PEFT folder "
                                              r"\(hf\) or MiniMind's LoRA .pth \(pth\)"):
        export_checkpoint(Path(runs["root"]) / "dense-tp2-pp2-1f1b", tmp_path / "x", "minimind", adapters_only=True)


def test_merge_adds_the_scaled_product():
    a, b, w = torch.randn(2, 3), torch.randn(4, 2), torch.randn(4, 3)
    merged = merge_adapters({"l.weight": w, "l.lora_A.weight": a, "l.lora_B.weight": b}, scale=0.5)
    assert list(merged) == ["l.weight"]
    torch.testing.assert_close(merged["l.weight"], w + 0.5 * b @ a)


def test_default_targets_are_the_square_linears_and_patterns_match_name_ends():
    decoder = decoder_of(build_model(model_config(compose_run_config(["model=tiny-moe"], Path("unused")))))
    assert lora_targets(decoder, LoraSpec(rank=8)) == [f"model.layers.{i}.self_attn.{p}" for i in range(4)
                                                       for p in ("q_proj", "o_proj")]
    experts = lora_targets(decoder, LoraSpec(rank=8, targets=("experts.*.up_proj",)))
    assert len(experts) == 4 * 4 and all(n.endswith("up_proj") and ".experts." in n for n in experts)
    assert matches("q_proj", "model.layers.0.self_attn.q_proj") and not matches("proj", "model.layers.0.q_proj")
    assert matches("*_proj", "a.b.o_proj") and not matches("mlp.gate", "model.layers.0.mlp.gate_proj")


def test_a_first_stage_without_adapters_trains_nothing_and_the_rest_equals_one_process(tmp_path):
    """Adapters on the last layer only: the first stage holds no trainable weight (nothing to backward there)."""
    from tests.equivalence import EMU, run_training

    args = ["train.steps=2", "model=tiny", "lora.rank=4", "lora.targets=[layers.3.self_attn.q_proj]",
            "schedule.n_microbatches=2"]
    reference = baseline(args, tmp_path / "cache", tmp_path / "one", 1)
    cfg = compose_run_config([*args, "parallel.pp=2", "schedule=zb-h1", EMU], tmp_path / "cache")
    results = [run_training(cfg, ParallelGrid.single(CPU), tmp_path / "pp2")]
    assert_equivalent(results, reference)
    assert [n for n in results[0]["params"] if is_adapter(n)] == ["model.layers.3.self_attn.q_proj.lora_A.weight",
                                                                  "model.layers.3.self_attn.q_proj.lora_B.weight"]


def test_adapters_take_the_zero_bubble_weight_split():
    """Under I/W the adapters' weight gradients wait for W (the frozen weights never get one), then equal B's."""
    from tests.test_runtime import batches, run_b_and_i, tiny

    grid = ParallelGrid.single(CPU)
    full, split = (apply_lora(tiny(moe=True), LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "down_proj")),
                              grid) for _ in range(2))
    for decoder in (full, split):  # lora_B starts at zero, where lora_A's gradient would be zero too
        for name, param in decoder.module.named_parameters():
            if name.endswith("lora_B.weight"):
                param.data.normal_(generator=torch.Generator().manual_seed(len(name)))
    a, b = run_b_and_i(full, split, batches(2))
    adapters = [n for n, _ in split.module.named_parameters() if is_adapter(n)]
    with_grad = {n for n, p in split.module.named_parameters() if p.grad is not None}
    # After I only idle experts' adapters hold a gradient (the zero the model's own forward hangs on them).
    assert with_grad <= set(adapters) and all(".experts." in n for n in with_grad), with_grad
    for mb in range(2):
        b.backward_weight(mb)
    assert sorted(n for n, p in split.module.named_parameters() if p.grad is not None) == sorted(adapters)
    for (name, p), q in zip(full.module.named_parameters(), split.module.parameters()):
        if is_adapter(name):
            assert p.grad.abs().sum() > 0, name
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_adapters_ride_the_linears_branch_not_a_copy_of_their_forward():
    """An adapted linear keeps its class's forward: a TP layer carries the adapter as its branch, sliced as the layer is
    (colwise: lora_B's rows, rowwise: lora_A's columns); a whole linear adds base + scale * B A x by a forward hook."""
    from parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from parallel.tensor_pass import shard_modules
    from tests.test_runtime import tiny
    from training.methods.lora import LowRank

    grid = ParallelGrid(tp=2)  # shapes and slices only: no forward, so no process group
    sharded = apply_lora(shard_modules(tiny(), grid), LoraSpec(rank=4, targets=("q_proj", "o_proj")), grid)
    q, o = (getattr(sharded.module.model.layers["0"].self_attn, name) for name in ("q_proj", "o_proj"))
    assert isinstance(q, ColumnParallelLinear) and isinstance(o, RowParallelLinear)
    for linear in (q, o):
        assert "forward" not in vars(linear) and isinstance(linear.branch, LowRank)
    assert (q.lora_A.weight.shape, q.lora_B.weight.shape, q.lora_B.weight.partition_dim) == ((4, 32), (16, 4), 0)
    assert (o.lora_A.weight.shape, o.lora_A.weight.partition_dim, o.lora_B.weight.shape) == ((4, 16), 1, (32, 4))

    whole = apply_lora(tiny(), LoraSpec(rank=4, alpha=8.0, targets=("q_proj",)), ParallelGrid.single(CPU))
    q = whole.module.model.layers["0"].self_attn.q_proj
    assert "forward" not in vars(q) and isinstance(q.branch, LowRank)
    q.lora_B.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.linear(x, q.weight, q.bias) + x @ q.lora_A.weight.T @ q.lora_B.weight.T * 2.0
    torch.testing.assert_close(q(x), want)


def optimizer_state_bytes(overrides: list[str], cache: Path) -> tuple[int, int]:
    """(bytes of AdamW state after one step, trained parameters) of a one-process run of `overrides`."""
    from parallel.engine import build_engine
    from training.optim import build_optimizer
    from training.specs import engine_spec
    from training.trainer import build_model as trainer_model

    cfg = compose_run_config(overrides, cache)
    decoder, weights = trainer_model(cfg)
    engine = build_engine(engine_spec(cfg, CPU), decoder, ParallelGrid.single(CPU), weights)
    optimizer = build_optimizer(engine.parameters(), cfg.optim)
    trained = [p for p in engine.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return state, sum(p.numel() for p in trained)


def test_optimizer_state_holds_only_the_adapters(tmp_path):
    """AdamW keeps two fp32 moments per trained element: under LoRA, per adapter element only.
    `python -c "from tests.test_lora import report; report()"` prints the figure at MiniMind's default size."""
    full, n_full = optimizer_state_bytes(["model=tiny"], tmp_path)
    lora, n_lora = optimizer_state_bytes(["model=tiny", "lora=minimind"], tmp_path)
    assert (full, lora) == (8 * n_full, 8 * n_lora)
    assert n_lora == 4 * 2 * (16 * 64 + 64 * 16)  # 4 layers x (q_proj, o_proj) x (lora_A + lora_B), rank 16
    print(f"tiny: AdamW state {full / 2**20:.3f} MiB -> {lora / 2**20:.3f} MiB under lora=minimind")


def report(model: str = "minimind3") -> None:
    """The optimizer-state figure at a real size (a command for the docs and reports, not a test)."""
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        full, n_full = optimizer_state_bytes([f"model={model}"], Path(cache))
        lora, n_lora = optimizer_state_bytes([f"model={model}", "lora=minimind"], Path(cache))
    print(f"model={model}: {n_full:,} trained parameters, AdamW state {full / 2**20:.1f} MiB; lora=minimind: "
          f"{n_lora:,} trained, AdamW state {lora / 2**20:.2f} MiB ({full / lora:.0f}x less)")


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=-1"], "lora.rank=-1 must be >= 0"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha=0.0 must be positive"),
    (["lora.rank=4", "lora.dropout=1"], "lora.dropout=1.0 must lie in [0, 1)"),
    (["lora.rank=4", "lora.targets=[lm_head,qproj]"],
     "lora.targets=['lm_head', 'qproj'] matches no linear of the decoder layers; name some of them (a pattern "
     "matches a name's end, `*` one component): self_attn.q_proj (64x64), self_attn.k_proj (64x32)"),
    (["lora.rank=4", "lora.targets=[]"], "lora.targets=[] matches no linear of the decoder layers"),
])
def test_bad_lora_configs_fail_before_launch(overrides, message, capsys):
    from training.launch.cli import preflight

    with pytest.raises(SystemExit) as exit_info:
        preflight(["model=tiny", *overrides])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_lora_keys_without_rank_are_ignored_with_a_warning(capsys):
    from training.launch.cli import preflight

    preflight(["model=tiny", "lora.alpha=16"])
    assert "lora.alpha=16.0 is read only when lora.rank>0 (here lora.rank=0); it is ignored" in capsys.readouterr().err


if __name__ == "__main__":  # python -m tests.test_lora [model preset]
    import sys

    report(*sys.argv[1:])


def test_lora_b_of_a_packed_shard_takes_each_parts_block_as_its_base_does():
    """Phi-3's qkv_proj at tp2 holds [q_r | k_r | v_r] (parts of 64, 32, 32 rows): lora_B's rows are this rank's of
    each part too, marked so that checkpoints join them by part."""
    from types import SimpleNamespace

    from parallel.blocks import local_block
    from training.methods.lora import _adapter_weight

    base = torch.nn.Parameter(torch.empty(64, 64))
    base.tensor_parallel, base.partition_dim, base.tp_packed = True, 0, (64, 32, 32)
    dense = torch.arange(128 * 4, dtype=torch.float32).view(128, 4)
    grid = SimpleNamespace(tp_rank=1, tp=2, device=torch.device("cpu"))
    weight = _adapter_weight(dense, 0, base, grid)
    assert torch.equal(weight, torch.cat([dense[32:64], dense[80:96], dense[112:128]]))
    assert torch.equal(weight, local_block(dense, 1, 2, 0, (64, 32, 32))) and weight.tp_packed == (64, 32, 32)
    assert not hasattr(_adapter_weight(dense.T.contiguous(), 1, base, grid), "tp_packed")  # lora_A: its input dim
