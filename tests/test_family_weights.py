"""transformers' families in and out: a sharded `save_pretrained` folder loads into a pp2 x tp2 run whose first
step's loss is the one transformers' own forward computes; its checkpoints resume bit for bit and reshard to one
process (packed experts included); the exported folder (no custom code, Phi-3's as `Phi3ForCausalLM` after its fused
projections trained split by heads) gives the trained model's logits."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoint.export import export_checkpoint
from models.family import build_model, model_config
from tests.equivalence import compose_run_config, dense_params, layouts_worker
from tests.shared import once_per_session
from tests.spawn import run_workers
from training.data import build_data

# The module's shared runs are set up inside its first test: under load that can take minutes, so the
# per-test bound is the whole module's, not pytest.ini's 600 s for one test.
pytestmark = pytest.mark.timeout(1800)

# tied (stored once); packed experts under TP; Phi-3's fused [q|k|v] and [gate|up] split by heads (packed by parts)
PRESETS = {"qwen3": "qwen3-tiny", "qwen3-moe": "qwen3-moe-tiny", "phi3": "phi3-tiny"}
LAYOUT = ["parallel.pp=2", "parallel.tp=2", "schedule=1f1b", "schedule.n_microbatches=4", "train.steps=4",
          "checkpoint.every=2"]
STEP2 = "checkpoints/step_00000002"


def saved_folder(root: Path, preset: str) -> Path:
    """A model of the preset with fresh weights, saved by transformers in several safetensors shards plus an index."""
    torch.manual_seed(11)
    model = build_model(model_config({"hf_config": f"models/configs/{preset}"}), "cpu")
    folder = root / f"hf-{preset}"
    model.save_pretrained(str(folder), max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 2
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every preset loaded from its folder and trained at pp2 x tp2 (one spawn of four processes)."""
    def compute(root: Path) -> dict:
        folders = {family: saved_folder(root, preset) for family, preset in PRESETS.items()}
        runs = [([*LAYOUT, f"model={preset}", f"checkpoint.load_dense={folders[family]}"], str(root / f"run-{family}"))
                for family, preset in PRESETS.items()]
        resumed = [*LAYOUT, "model=qwen3-moe-tiny", f"checkpoint.resume={root / 'run-qwen3-moe' / STEP2}"]
        by_rank = run_workers(layouts_worker, 4, [*runs, (resumed, str(root / "resumed"))], str(root / "cache"),
                              timeout=540)
        return {"root": root, "folders": folders, "runs": runs, "resumed": [r[-1] for r in by_rank],
                "results": {family: [r[i] for r in by_rank] for i, family in enumerate(PRESETS)}}

    return once_per_session(tmp_path_factory, "family-weights", compute)


def test_a_checkpoint_with_packed_experts_resumes_bit_for_bit(trained):
    """Qwen3-MoE's stacked gate/up experts are two blocks per TP rank: saved whole, sliced again on load."""
    straight, resumed = trained["results"]["qwen3-moe"], trained["resumed"]
    for full, tail in zip(straight, resumed):
        assert tail["losses"] == full["losses"][2:]
        for name, (tensor, *_) in full["params"].items():
            assert torch.equal(tensor, tail["params"][name][0]), name


def test_it_reshards_to_one_process(trained):
    from parallel.grid import ParallelGrid
    from tests.equivalence import run_training

    overrides = ["schedule.n_microbatches=4", "train.steps=4", "checkpoint.every=2", "model=qwen3-moe-tiny",
                 f"checkpoint.resume={trained['root'] / 'run-qwen3-moe' / STEP2}"]
    cfg = compose_run_config(overrides, trained["root"] / "cache")
    one = run_training(cfg, ParallelGrid.single(torch.device("cpu")), trained["root"] / "one-process")
    straight = trained["results"]["qwen3-moe"]
    assert one["losses"] == pytest.approx(straight[0]["losses"][2:], rel=1e-5)
    expected, got = dense_params(straight, tied=False), dense_params([one], tied=False)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert ((got[name] - tensor).norm() / tensor.norm()).item() <= 1e-4, name


@pytest.mark.parametrize("family", list(PRESETS))
def test_first_step_loss_is_transformers_own(trained, family):
    """The pp2 x tp2 run's first loss against transformers' forward of the loaded folder on the same micro-batches."""
    overrides, _ = trained["runs"][list(PRESETS).index(family)]
    cfg = compose_run_config(overrides, trained["root"] / "cache")
    micro_batches = build_data(cfg, 0, 1, verbose=False)[0].batch(0)
    model = AutoModelForCausalLM.from_pretrained(str(trained["folders"][family]), attn_implementation="sdpa")
    tokens = sum(mb.num_label_tokens() for mb in micro_batches)
    # HF's causal-LM loss with num_items_in_batch is the token sum over the global count; the router loss, which
    # transformers would add to it, Sluice logs apart (aux_loss).
    extra = {"output_router_logits": False} if family == "qwen3-moe" else {}
    with torch.no_grad():
        loss = sum(model(input_ids=mb.input_ids, labels=mb.labels, num_items_in_batch=tokens, **extra).loss.item()
                   for mb in micro_batches)
    first = trained["results"][family][0]["losses"][0]
    assert first == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("family", list(PRESETS))
def test_exported_folder_loads_without_custom_code_and_gives_the_trained_logits(trained, family, tmp_path):
    _, run_dir = trained["runs"][list(PRESETS).index(family)]
    out = export_checkpoint(run_dir, tmp_path / "export")
    assert not list(out.glob("*.py")), "a stock architecture needs no modeling code"
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["model_type"] == PRESETS[family].removesuffix("-tiny").replace("-", "_")
    assert (out / "tokenizer.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="sdpa").eval()
    trained_model = build_model(model_config({"hf_config": f"models/configs/{PRESETS[family]}"}), "cpu").eval()
    assert type(exported) is type(trained_model)  # transformers' own class: Phi3ForCausalLM for phi3
    weights = dense_params(trained["results"][family], tied=exported.config.tie_word_embeddings)
    trained_model.load_state_dict(weights, strict=not exported.config.tie_word_embeddings)
    ids = torch.randint(0, exported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # the same weights; a CPU kernel may round differently with another memory alignment
        torch.testing.assert_close(exported(input_ids=ids).logits, trained_model(input_ids=ids).logits, rtol=0,
                                   atol=1e-5)
