"""A MiniMind model exports as the stock transformers family it equals (Qwen3 / Qwen3-MoE: keys strict, logits equal),
loading with AutoModelForCausalLM and AutoTokenizer without custom code; its adapters export as MiniMind's LoRA .pth
that MiniMind's own `apply_lora` + `load_lora` take; any export loads back as `model.hf_config` and
`checkpoint.load_dense`; generate.py runs a folder's code only with --trust-remote-code."""

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoint.adapters import MINIMIND_RANK, read_minimind_lora
from checkpoint.dense import CheckpointError, load_dense_into
from checkpoint.export import build_model, export_checkpoint, read_training_weights, save_hf_folder
from checkpoint.lora_merge import is_adapter, merge_adapters
from checkpoint.stock import stock_config, stock_model
from minimind import MiniMindConfig, MiniMindForCausalLM
from models import build_model as build_module, model_config
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training
from tests.test_scripts import one_line_failure, script

RANK, ALPHA = 8, 32.0  # below MiniMind's 16 (the export pads) and a scale of 4 (folded into B)
IDS = torch.arange(3, 35).view(2, 16)


def logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("kind, family", [("dense", "Qwen3ForCausalLM"), ("moe", "Qwen3MoeForCausalLM")])
def test_minimind_is_the_stock_family_it_equals(kind, family, tmp_path, request):
    golden = request.getfixturevalue(f"golden_{kind}")
    model = MiniMindForCausalLM(MiniMindConfig(**golden["config"]))
    model.load_state_dict(golden["state_dict"], strict=True)
    folder = save_hf_folder(model, tmp_path / "out")
    assert not (folder / "model.py").exists() and "auto_map" not in (folder / "config.json").read_text()
    stock, info = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False, output_loading_info=True)
    assert type(stock).__name__ == family
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    expected = golden["logits"] if kind == "dense" else golden["eval_logits"]
    torch.testing.assert_close(logits(stock, golden["input_ids"]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("field, value, why", [
    ("inference_rope_scaling", True, "model.inference_rope_scaling=true (MiniMind's own YaRN) has no exact stock "
                                     "equivalent"),
    ("dropout", 0.1, "model.dropout=0.1 (MiniMind's residual dropout) has no stock equivalent")])
def test_no_stock_family_falls_back_to_minimind_and_says_why(field, value, why, tmp_path, caplog):
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=128, max_position_embeddings=64, **{field: value})
    assert stock_config(config) == (None, why)
    with caplog.at_level(logging.WARNING, logger="sluice"):
        folder = save_hf_folder(MiniMindForCausalLM(config), tmp_path / "out")
    assert (folder / "model.py").is_file()
    assert f"export: {why}: writing MiniMind's own format (load it with trust_remote_code=True)" in caplog.text


def test_a_wrong_mapping_is_refused_before_writing(golden_dense, monkeypatch, tmp_path):
    model = MiniMindForCausalLM(MiniMindConfig(**golden_dense["config"]))
    model.load_state_dict(golden_dense["state_dict"], strict=True)
    mapped, _ = stock_config(model.config)
    mapped.rms_norm_eps = 0.5  # a mapping mistake: the numbers differ
    monkeypatch.setattr("checkpoint.stock.stock_config", lambda config: (mapped, None))
    with pytest.raises(CheckpointError, match=r"MiniMind -> Qwen3ForCausalLM: the logits differ by .* export with "
                                              r"--format minimind"):
        stock_model(model)
    with pytest.raises(CheckpointError):
        save_hf_folder(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """One LoRA run on the tiny MiniMind (rank 8, alpha 32), its final checkpoint written."""
    root = tmp_path_factory.mktemp("lora-run")
    cfg = compose_run_config(["model=tiny", "train.steps=2", "schedule.n_microbatches=1", "optim.lr=0.05",
                              f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "checkpoint.save_final=true"], root / "cache")
    run_training(cfg, ParallelGrid.single("cpu"), root / "run")
    return root / "run"


def trained(run: Path) -> tuple[nn.Module, nn.Module, dict]:
    """The merged model the run trained, its base model (adapters left out) and the dense state."""
    state, meta = read_training_weights(run)
    merged = build_model(meta["model"], merge_adapters(state, ALPHA / RANK))
    base = build_model(meta["model"], {k: v for k, v in state.items() if not is_adapter(k)})
    return merged, base, state


def test_the_default_export_loads_without_custom_code_and_equals_the_trained_logits(lora_run, tmp_path, capsys):
    merged, _, _ = trained(lora_run)
    out = tmp_path / "hf"
    assert script("export_hf").main([str(lora_run), str(out)]) == 0
    assert f"wrote {out} (Qwen3ForCausalLM; loads without trust_remote_code)" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=False)
    torch.testing.assert_close(logits(model), logits(merged), atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    assert tokenizer.chat_template and tokenizer("the cat").input_ids

    for fmt, folder in (("hf", out), ("minimind", export_checkpoint(lora_run, tmp_path / "mm", fmt="minimind"))):
        config = model_config({"name": "x", "hf_config": str(folder)})  # Sluice's own export as model.hf_config
        assert config.model_type == ("qwen3" if fmt == "hf" else "minimind")
        for run_model in (build_module(config, "cpu"), build_module(model_config({"name": "tiny", **TINY}), "cpu")):
            load_dense_into(run_model, folder)  # and as checkpoint.load_dense, into either family
            torch.testing.assert_close(logits(run_model), logits(merged), atol=1e-5, rtol=0)


TINY = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 2048, "max_position_embeddings": 256}


def test_generate_runs_a_folders_code_only_when_trusted(lora_run, tmp_path, capsys):
    folder = export_checkpoint(lora_run, tmp_path / "mm", fmt="minimind")
    generate = script("generate")
    line = one_line_failure(generate, [str(folder), "the cat", "--max-new-tokens", "2"], capsys)
    assert line == (f"generate: {folder} ships its own modeling code (auto_map in its config.json); pass "
                    "--trust-remote-code to run it if you trust the folder, or export with --format hf (stock "
                    "transformers classes)")
    assert generate.main([str(folder), "the cat", "--max-new-tokens", "2", "--trust-remote-code"]) == 0


class MiniMindLoRA(nn.Module):
    """MiniMind's model/model_lora.py LoRA module, as documented: A [rank, in], B [out, rank], output B(A(x))."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.B(self.A(x))


def minimind_apply_lora(model: nn.Module, rank: int = MINIMIND_RANK) -> None:
    """MiniMind's apply_lora: every square nn.Linear gains `.lora`, its forward adds lora(x)."""
    for module in list(model.modules()):
        if isinstance(module, nn.Linear) and module.in_features == module.out_features:
            module.lora = MiniMindLoRA(module.in_features, module.out_features, rank)
            module.forward = lambda x, base=module.forward, lora=module.lora: base(x) + lora(x)


def minimind_load_lora(model: nn.Module, path: Path) -> None:
    """MiniMind's load_lora: each adapted linear loads its `<name>.lora.*` entries strictly."""
    state = torch.load(path, weights_only=True)
    state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
    for name, module in model.named_modules():
        if hasattr(module, "lora"):
            module.lora.load_state_dict({k.replace(f"{name}.lora.", ""): v for k, v in state.items()
                                         if f"{name}.lora." in k})


def test_adapters_export_as_minimind_lora_and_read_back(lora_run, tmp_path, capsys):
    merged, base, state = trained(lora_run)
    out = tmp_path / "lora"
    assert script("export_hf").main([str(lora_run), str(out), "--format", "pth", "--adapters-only"]) == 0
    path = out / "lora_64.pth"
    assert f"wrote {path} (MiniMind's LoRA: apply_lora(model) then load_lora(model, path))" in capsys.readouterr().out
    keys = set(torch.load(path, weights_only=True))
    assert "model.layers.0.self_attn.q_proj.lora.A.weight" in keys and len(keys) == 4 * 4  # q, o x 4 layers x A, B
    minimind_apply_lora(base)  # MiniMind's trainer and eval_llm.py: apply_lora(model), rank 16
    minimind_load_lora(base, path)
    torch.testing.assert_close(logits(base), logits(merged), atol=1e-5, rtol=0)

    back = read_minimind_lora(path, RANK, ALPHA / RANK)  # the padded rank cut back, the scale taken out of B
    assert set(back) == {k for k in state if is_adapter(k)}
    for name, tensor in back.items():
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=1e-6)
    with pytest.raises(CheckpointError, match=r"its adapters have rank 16; set lora.rank=16"):
        read_minimind_lora(path, 4, 1.0)


def test_adapters_on_a_non_square_linear_do_not_fit_minimind(tmp_path):
    from checkpoint.adapters import minimind_lora_state

    model = MiniMindForCausalLM(MiniMindConfig(**TINY))
    state = {"model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(2, 64),
             "model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(32, 2),
             "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj \(64x32, in x out\) has an adapter, "
                                              r"and MiniMind's apply_lora adapts square linears only"):
        minimind_lora_state(state, {"rank": 2, "alpha": 2.0}, model)
