"""Exports load on transformers 4.x (MiniMind pins 4.57.6) as on 5.x: the files carry what 4.57's loading code reads
(checked against the fields and class names written down below from its source), a greedy answer from those fields
alone equals 5.x's, a MiniMind tokenizer config is kept as written, and a folder whose two RoPE fields disagree is
refused in one line."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

from checkpoint.compat import keep_written_config
from checkpoint.export import save_hf_folder
from minimind import MiniMindConfig, MiniMindForCausalLM
from models.config_values import config_values_problem
from tests.test_scripts import script
from training.data import synthetic_corpus, train_bpe_tokenizer

# What transformers 4.57.6 reads, from its wheel (transformers-4.57.6-py3-none-any.whl):
# models/qwen3/configuration_qwen3.py:155-178, Qwen3Config.__init__'s arguments (RoPE: `rope_theta` and
# `rope_scaling`; `rope_parameters` is not among them and is ignored).
QWEN3_457 = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
             "rms_norm_eps", "use_cache", "tie_word_embeddings", "rope_theta", "rope_scaling", "attention_bias",
             "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "attention_dropout")
# models/qwen3_moe/configuration_qwen3_moe.py:170-197, Qwen3MoeConfig.__init__ adds these (head_dim arrives as a kwarg).
QWEN3_MOE_457 = QWEN3_457 + ("decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_experts",
                             "norm_topk_prob", "router_aux_loss_coef", "mlp_only_layers")
# Fields whose 4.57 default differs from a MiniMind export's value, so they must be written (4.57 defaults:
# rope_theta 10000.0 (configuration_qwen3.py:170; read at modeling_rope_utils.py:123 `base = config.rope_theta`),
# tie_word_embeddings False (:169); Qwen3-MoE's num_experts 128 (configuration_qwen3_moe.py:193), which 5.x writes as
# num_local_experts). head_dim (Qwen3's default 128, :163) where 5.x writes it; Qwen3-MoE 4.57 derives it,
# modeling_qwen3_moe.py:129 `getattr(config, "head_dim", hidden_size // num_attention_heads)`, MiniMind's value.
MUST_BE_WRITTEN = ("rope_theta", "tie_word_embeddings", "vocab_size", "hidden_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "intermediate_size")
# models/auto/tokenization_auto.py:807-834 tokenizer_class_from_name: "PreTrainedTokenizerFast" (:808) or a class of its
# TOKENIZER_MAPPING_NAMES; "TokenizersBackend" (5.x's) is neither: "does not exist or is not currently imported"
# (:1154).
TOKENIZER_CLASSES_457 = ("PreTrainedTokenizerFast", "Qwen2TokenizerFast", "LlamaTokenizerFast")
# tokenization_utils_base.py:1471-1472 + 1203-1215: `extra_special_tokens` is a dict of named tokens (`.items()`),
# each a str or AddedToken; a list raises AttributeError.
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 8]])


@pytest.fixture(scope="module")
def tokenizer_5x(tmp_path_factory) -> Path:
    """A tokenizer folder as transformers 5 writes it (TokenizersBackend, extra_special_tokens as a list)."""
    folder = tmp_path_factory.mktemp("tok") / "tokenizer"
    tokenizer = train_bpe_tokenizer(synthetic_corpus(60, seed=0), vocab_size=300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.save_pretrained(folder)
    written = json.loads((folder / "tokenizer_config.json").read_text())
    assert written["tokenizer_class"] == "TokenizersBackend" and isinstance(written["extra_special_tokens"], list)
    return folder


def exported(request, kind: str, folder: Path, tokenizer: Path) -> Path:
    golden = request.getfixturevalue(f"golden_{kind}")
    model = MiniMindForCausalLM(MiniMindConfig(**golden["config"]))
    model.load_state_dict(golden["state_dict"], strict=True)
    return save_hf_folder(model, folder, tokenizer)


def greedy(model: torch.nn.Module, n: int = 8) -> list[int]:
    with torch.no_grad():
        return model.eval().generate(PROMPT, max_new_tokens=n, do_sample=False, pad_token_id=0)[0, 6:].tolist()


@pytest.mark.parametrize("kind, fields, config_class", [("dense", QWEN3_457, Qwen3Config),
                                                          ("moe", QWEN3_MOE_457, Qwen3MoeConfig)])
def test_export_carries_what_transformers_457_reads(kind, fields, config_class, tokenizer_5x, tmp_path, request):
    folder = exported(request, kind, tmp_path / "out", tokenizer_5x)
    config = json.loads((folder / "config.json").read_text())
    needed = MUST_BE_WRITTEN + (("head_dim",) if kind == "dense" else ("num_experts",))
    assert [f for f in needed if f not in config] == []
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1e6 and config["rope_scaling"] is None
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] in TOKENIZER_CLASSES_457
    assert isinstance(tok["extra_special_tokens"], dict) and all(isinstance(v, str) for v in
                                                                  tok["extra_special_tokens"].values())
    assert {"<|im_start|>", "<|im_end|>"} <= set(tok["additional_special_tokens"])  # what the list held, kept
    # Acceptance: the model built from only the fields 4.57 reads answers as transformers 5's own load of the folder.
    five = AutoModelForCausalLM.from_pretrained(str(folder))
    four = AutoModelForCausalLM.from_config(config_class(**{f: config[f] for f in fields if f in config}))
    four.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    four.tie_weights()
    assert four.config.rope_parameters["rope_theta"] == 1e6
    assert greedy(four) == greedy(five)
    loaded = AutoTokenizer.from_pretrained(str(folder))  # 5.x still reads the rewritten tokenizer config
    assert loaded("the cat").input_ids == AutoTokenizer.from_pretrained(str(tokenizer_5x))("the cat").input_ids


def test_minimind_tokenizer_config_is_kept_as_written(tokenizer_5x, tmp_path, request):
    own = tmp_path / "minimind_tokenizer"
    own.mkdir()
    (own / "tokenizer.json").write_bytes((tokenizer_5x / "tokenizer.json").read_bytes())
    text = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
                       "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                       "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "add_bos_token": False},
                      indent=2)  # MiniMind's own form (model/tokenizer_config.json), which 4.x and 5.x both read
    (own / "tokenizer_config.json").write_text(text)
    folder = exported(request, "dense", tmp_path / "out", own)
    assert (folder / "tokenizer_config.json").read_text() == text
    saved = tmp_path / "checkpoint_tokenizer"  # a checkpoint saves it with 5.x, then keeps the file as written
    tokenizer = AutoTokenizer.from_pretrained(str(own))
    tokenizer.save_pretrained(saved)
    keep_written_config(tokenizer, saved)
    assert (saved / "tokenizer_config.json").read_text() == text
    assert AutoTokenizer.from_pretrained(str(saved))("the cat").input_ids == tokenizer("the cat").input_ids


def test_disagreeing_rope_fields_are_refused_in_one_line():
    data = {"model_type": "qwen3", "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 1e6}}
    line = config_values_problem(data, "model.hf_config=out: config.json's")
    assert line == ("model.hf_config=out: config.json's rope_theta=10000.0 and rope_parameters.rope_theta=1000000.0 "
                    "disagree (transformers 4 reads the first, 5 the second: one of them would run a wrong RoPE); "
                    "set both to the trained value")
    assert config_values_problem({**data, "rope_theta": 1e6}, "x") is None


def test_the_second_transformers_check_runs_both_loads(tokenizer_5x, tmp_path, request, capsys):
    folder = exported(request, "dense", tmp_path / "out", tokenizer_5x)
    check = script("check_other_transformers")
    assert check.main([str(folder), "--python", sys.executable, "--tokens", "4"]) == 0  # here both sides are 5.x
    assert capsys.readouterr().out.strip().endswith("same answer")
    assert check.main([str(tmp_path), "--python", sys.executable]) == 2
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["llama-tiny", "phi3-tiny", "gemma3-tiny", "qwen3-moe-tiny"])
def test_a_transformers_family_exports_its_rope_both_ways(preset, tmp_path):
    from transformers import AutoConfig

    from tests.conftest import ROOT

    config = AutoConfig.from_pretrained(str(ROOT / "models" / "configs" / preset))
    folder = save_hf_folder(AutoModelForCausalLM.from_config(config), tmp_path / "out")
    written = json.loads((folder / "config.json").read_text())
    rope = written["rope_parameters"]
    full = rope.get("full_attention", rope)  # Gemma 3: per attention type; 4.57 reads the full one as rope_theta
    assert written["rope_theta"] == full["rope_theta"]
    assert written.get("partial_rotary_factor", 1.0) == rope.get("partial_rotary_factor", 1.0)
    assert AutoConfig.from_pretrained(str(folder)).rope_parameters == config.rope_parameters  # 5.x reads as before
