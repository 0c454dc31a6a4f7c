"""transformers' own families (every registered one: Llama untied, Qwen3 tied, Qwen3-MoE with its aux loss on,
Mistral, Gemma3, Phi-3, OLMo2), unmodified, trained by the plans their classes declare (Phi-3's fused projections
split by heads, as its adapter plans them): every layout equals one process in loss, aux loss, grad norm, gradients
and parameters.

Every registered family runs the acceptance layouts (tp2 x pp2 with selective recompute, dp2 x pp2 ZB-V); the first
three also every layout of the original list. A world-2 layout is one job on the session's pool of two processes, run
when its test first asks for it (a family's mistake fails that family's tests only; `-k <family>` runs that family's
jobs alone); the world-1 ones (emulated) run here.
"""

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from models import decoder_of
from models.family import SUPPORTED, build_model, model_config
from models.registry import FAMILIES as REGISTRY
from parallel.pipeline.lowered import lower_pipeline
from tests.equivalence import (FP32, assert_equivalent, assert_equivalent_bf16, baseline, compose_run_config,
                               layouts_worker, run_training)
from tests.shared import once_per_session
from tests.spawn import run_workers
from tests.test_equivalence import assert_tied_copies_bitwise_equal
from training.specs import pipeline_spec

# The module's shared runs are set up inside its first test: under load that can take minutes, so the
# per-test bound is the whole module's, not pytest.ini's 600 s for one test.
pytestmark = pytest.mark.timeout(1800)

STEPS = ["train.steps=3", "schedule.n_microbatches=4", "checkpoint.save_final=false"]
EMU = "parallel.emulate=true"
# Every transformers family of the registry, by preset (MiniMind's layouts are test_equivalence's).
FAMILIES = {preset: [f"model={preset}"] for family in REGISTRY.values() if family.model_type != "minimind"
            for preset in family.presets}
DEEP = ("llama-tiny", "qwen3-tiny", "qwen3-moe-tiny")  # the families that came first: every layout below


@dataclass(frozen=True)
class Layout:
    """One layout of the acceptance list; `world` processes (dp * tp, or dp * tp * pp when not emulated)."""

    name: str
    args: tuple[str, ...]
    world: int
    dp: int
    run: tuple[str, ...] = ()  # shared with the single-process baseline (e.g. the compute dtype)


LAYOUTS = [
    Layout("pp2-1f1b", ("parallel.pp=2", "schedule=1f1b"), 2, 1),  # real P2P between two processes
    Layout("tp2-pp2-vpp2-interleaved", ("parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                                        "schedule=interleaved-1f1b", EMU), 2, 1),
    # Beyond the acceptance list: ZB-H1's I/W split with ZeRO-1, recompute and an uneven partition in one run (pp2
    # ZB-V is the acceptance's dp2-pp2-zbv); bf16 against a bf16 process, at tolerances derived from bf16 (seed 39:
    # the tied pair's other summation order flips a bf16 cast by step 3 on this suite's AMD EPYC, so the case tests
    # that path here, not only on the machines where seed 0 flips one; see tests.equivalence.bf16_tolerances).
    Layout("dp2-pp2-zb-h1-zero1-selective-3-1", ("parallel.dp=2", "parallel.zero=1", "train.recompute=selective",
                                                 "parallel.pp=2", "schedule=zb-h1", "parallel.layers_per_stage=[3,1]",
                                                 EMU), 2, 2),
    Layout("bf16-pp2-full-recompute", ("parallel.pp=2", "train.recompute=full", EMU), 1, 1,
           ("train.dtype=bf16", "train.seed=39")),
]
ACCEPTANCE = [
    Layout("tp2-pp2-1f1b-selective", ("parallel.tp=2", "parallel.pp=2", "schedule=1f1b", "train.recompute=selective",
                                      EMU), 2, 1),
    Layout("dp2-pp2-zbv", ("parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv", EMU), 2, 2),
]
CASES = [(family, layout) for family in FAMILIES for layout in ACCEPTANCE] + \
    [(family, layout) for family in DEEP for layout in LAYOUTS]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A shared data cache and memoised baselines."""
    return {"root": tmp_path_factory.mktemp("families"), "baselines": {}, "factory": tmp_path_factory}


def _overrides(family: str, layout: Layout) -> list[str]:
    return [*STEPS, *FAMILIES[family], *layout.run, *layout.args]


def _reference(workspace, family: str, layout: Layout) -> dict:
    key = (family, layout.dp, layout.run)
    if key not in workspace["baselines"]:
        run_dir = workspace["root"] / f"baseline-{family}-{len(workspace['baselines'])}"
        workspace["baselines"][key] = baseline([*STEPS, *FAMILIES[family], *layout.run], workspace["root"] / "cache",
                                               run_dir, layout.dp)
    return workspace["baselines"][key]


def _results(workspace, family: str, layout: Layout) -> list[dict]:
    root, cache = workspace["root"], workspace["root"] / "cache"
    if layout.world == 1:
        from parallel.grid import ParallelGrid

        cfg = compose_run_config(_overrides(family, layout), cache)
        return [run_training(cfg, ParallelGrid.single(torch.device("cpu")), root / f"{family}-{layout.name}")]
    def compute(shared: Path) -> list[dict]:
        by_rank = run_workers(layouts_worker, 2, [(_overrides(family, layout), str(shared / "run"))], str(cache),
                              timeout=300)
        return [runs[0] for runs in by_rank]

    return once_per_session(workspace["factory"], f"families-world2-{family}-{layout.name}", compute)


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{c.name}" for f, c in CASES])
def test_family_layout_equals_single_process(workspace, family, layout):
    reference = _reference(workspace, family, layout)
    results = _results(workspace, family, layout)
    if "train.dtype=bf16" in layout.run:
        fp32 = _reference(workspace, family, replace(layout, run=(*layout.run, "train.dtype=fp32")))
        assert_equivalent_bf16(results, reference, fp32)
    else:
        assert_equivalent(results, reference, FP32)
    cfg = compose_run_config(_overrides(family, layout), workspace["root"] / "cache")
    config = model_config({"hf_config": cfg.model.hf_config})
    if getattr(config, "output_router_logits", False):  # the load-balancing loss is on and reaches the metrics
        assert all(m["aux_loss"] > 0 for m in reference["metrics"]), reference["metrics"]
    if config.tie_word_embeddings and lower_pipeline(pipeline_spec(cfg), config.num_hidden_layers).placement != "v":
        assert_tied_copies_bitwise_equal(results, steps=3)


BF16_CASE = next(layout for layout in LAYOUTS if "train.dtype=bf16" in layout.run)


@pytest.mark.parametrize("kernel,threads", [("fused", 2), ("loop", 1), ("loop", 2)])
def test_a_verdict_does_not_depend_on_the_adamw_kernel_or_the_threads(workspace, monkeypatch, kernel, threads):
    """The Qwen3 (tied) pp2 case, bf16 and fp32, under the AdamW kernel the suite does not use and with 2 intra-op
    threads (the suite's processes run 1; `fused` with 1 is the case above): both kernels and thread counts round
    differently, and a verdict that changed with them would hold by the CPU's rounding luck, not by the tolerances.
    Every variant runs its own references, so each is compared with one process under the same kernel and threads."""
    import training.optim

    if kernel == "loop":  # torch's per-parameter loop, its default on CPU (what the fused kernel replaced)
        monkeypatch.setattr(training.optim, "kernel", lambda params: {"foreach": False})
    from parallel.grid import ParallelGrid

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        root, cache = workspace["root"] / f"variant-{kernel}-{threads}", workspace["root"] / "cache"
        runs = {}
        for dtype in ("bf16", "fp32"):
            overrides = [*_overrides("qwen3-tiny", BF16_CASE), f"train.dtype={dtype}"]
            reference = baseline([*STEPS, *FAMILIES["qwen3-tiny"], *BF16_CASE.run, f"train.dtype={dtype}"], cache,
                                 root / f"baseline-{dtype}", 1)
            layout = run_training(compose_run_config(overrides, cache), ParallelGrid.single(torch.device("cpu")),
                                  root / dtype)
            runs[dtype] = ([layout], reference)
    finally:
        torch.set_num_threads(before)
    assert_equivalent(*runs["fp32"], FP32)
    assert_equivalent_bf16(*runs["bf16"], runs["fp32"][1])


def test_the_presets_are_the_families_the_acceptance_names():
    """Llama untied, Qwen3 tied, Qwen3-MoE with its aux loss on, Mistral, Gemma3 text, Phi-3 (fused projections),
    OLMo2 (norms over the whole q and k): transformers' own classes."""
    classes = {}
    for family in FAMILIES:
        config = model_config({"hf_config": f"models/configs/{family}"})
        model = build_model(config)
        classes[family] = (type(model).__module__.split(".")[:2], type(model).__name__, config.tie_word_embeddings)
    assert classes == {"llama-tiny": (["transformers", "models"], "LlamaForCausalLM", False),
                       "qwen3-tiny": (["transformers", "models"], "Qwen3ForCausalLM", True),
                       "qwen3-moe-tiny": (["transformers", "models"], "Qwen3MoeForCausalLM", False),
                       "mistral-tiny": (["transformers", "models"], "MistralForCausalLM", False),
                       "gemma3-tiny": (["transformers", "models"], "Gemma3ForCausalLM", True),
                       "phi3-tiny": (["transformers", "models"], "Phi3ForCausalLM", False),
                       "olmo2-tiny": (["transformers", "models"], "Olmo2ForCausalLM", False)}
    assert model_config({"hf_config": "models/configs/qwen3-moe-tiny"}).output_router_logits


def test_pruning_a_module_list_keeps_dense_names():
    """transformers keeps its layers in an nn.ModuleList; a pruned chunk keeps `model.layers.<global id>.`."""
    decoder = decoder_of(build_model(model_config({"hf_config": "models/configs/llama-tiny"})))
    chunk = decoder.prune(range(2, 4), first=False, last=True)
    names = [n for n, _ in chunk.module.named_parameters()]
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"2", "3"}
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" in names
    assert set(names) <= {n for n, _ in decoder.module.named_parameters()}


def _folder_with(tmp_path, model_type: str) -> str:
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    return str(folder)


BAD = [
    (lambda tmp: [f"model.hf_config={_folder_with(tmp, 'gpt2')}"],
     "model_type 'gpt2' declares no pipeline plan (base_model_pp_plan) and has no Sluice adapter; "
     f"Sluice trains {SUPPORTED}"),
    (lambda tmp: [f"model.hf_config={_folder_with(tmp, 'starcoder2')}"],
     f"model_type 'starcoder2' declares a pipeline plan and has no Sluice adapter; Sluice trains {SUPPORTED}"),
    (lambda tmp: [f"model.hf_config={tmp}"], "has no config.json; give a folder written by save_pretrained"),
    (lambda tmp: ["model=llama-tiny", "parallel.tp=3"],
     "parallel.tp=3 does not divide num_attention_heads=4; choose tp in {1, 2}"),
    (lambda tmp: ["model=qwen3-moe-tiny", "model.moe_intermediate_size=33", "parallel.tp=2"],
     "parallel.tp=2 does not divide moe_intermediate_size=33; choose tp in {1}"),
    (lambda tmp: ["model=llama-tiny", "model.use_moe=true"],
     "model.use_moe does not apply to llama models; set it in model.hf_config's config.json or drop the override"),
]


@pytest.mark.parametrize("args, expected", BAD, ids=["gpt2", "starcoder2", "no-config", "llama-tp3", "moe-tp2",
                                                     "llama-use-moe"])
def test_an_uncovered_architecture_or_bad_split_is_one_line_before_launch(args, expected, tmp_path, capsys):
    from tests.test_config_catalogue import run_preflight
    from training.config import register_schema

    register_schema()
    code, lines = run_preflight([*args(tmp_path), f"hydra.run.dir={tmp_path}/run"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_matmul_weights_per_token_are_the_linears_a_token_meets(preset):
    """FLOPs and MFU count every projection, the head once, and of the experts only the top-k a token runs through."""
    config = model_config({"hf_config": f"models/configs/{preset}"})
    model = build_model(config)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    routers = sum(p.numel() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))  # h x E each
    share = config.num_experts_per_tok / config.num_experts if experts else 0.0
    assert decoder_of(model).adapter.matmul_params_per_token() == linears + routers + int(experts * share)


def test_tp_need_divide_only_what_the_plan_splits():
    """OLMo2 gathers q, k and v (every rank computes every head): tp=4 divides their widths though not its 2
    key/value heads; Phi-3 splits its fused [q|k|v] by heads, so there tp must divide the head counts."""
    from parallel.tensor_pass import check_tp_divisibility

    olmo2 = decoder_of(build_model(model_config({"hf_config": "models/configs/olmo2-tiny"}))).adapter.tp_sizes()
    assert "num_key_value_heads" not in olmo2 and olmo2["num_key_value_heads*head_dim"] == 32
    check_tp_divisibility(olmo2, 4)
    phi3 = decoder_of(build_model(model_config({"hf_config": "models/configs/phi3-tiny"}))).adapter.tp_sizes()
    with pytest.raises(ValueError, match=r"parallel.tp=4 does not divide num_key_value_heads=2; choose tp in \{1, 2\}"):
        check_tp_divisibility(phi3, 4)
