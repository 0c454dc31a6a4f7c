"""The model against the public MiniMind-3 reference: keys, logits, losses, gradients, HF round trips."""

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import minimind
from minimind import MiniMindConfig, MiniMindForCausalLM

ATOL = 1e-5


def golden_model(golden: dict, train: bool = False) -> MiniMindForCausalLM:
    model = MiniMindForCausalLM(MiniMindConfig(**golden["config"]))
    model.load_state_dict(golden["state_dict"], strict=True)
    return model.train(train)


def test_dense_golden_logits_and_loss(golden_dense):
    model = golden_model(golden_dense)
    out = model(golden_dense["input_ids"], labels=golden_dense["input_ids"])
    torch.testing.assert_close(out.logits, golden_dense["logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, golden_dense["loss"], atol=ATOL, rtol=0)


def test_moe_golden_eval_and_train(golden_moe):
    ids = golden_moe["input_ids"]
    model = golden_model(golden_moe)
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.logits, golden_moe["eval_logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, golden_moe["eval_loss"], atol=ATOL, rtol=0)
    model.train()
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.loss, golden_moe["train_loss"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["aux_loss"], golden_moe["train_aux_loss"], atol=ATOL, rtol=0)
    (out.loss + out["aux_loss"]).backward()
    params = dict(model.named_parameters())
    assert golden_moe["grads"], "the golden file must carry gradients"
    for name, grad in golden_moe["grads"].items():
        torch.testing.assert_close(params[name].grad, grad, atol=ATOL, rtol=0, msg=name)


def per_token_moe(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMind's routed MLP as the reference describes it, one token at a time (written here, independent of
    minimind.model): softmax router, top-k experts, renormalised weights, SwiGLU experts; in training mode the
    aux loss sum(load * mean(scores)) * num_experts * coef."""
    tokens = x.reshape(-1, x.shape[-1])
    gate = block.gate.weight
    rows, all_scores, chosen_all = [], [], []
    for token in tokens:
        scores = torch.softmax(gate @ token, dim=-1)
        top = torch.topk(scores, block.top_k).indices
        weights = scores[top] / scores[top].sum() if block.norm_topk_prob else scores[top]
        out = torch.zeros_like(token)
        for weight, e in zip(weights, top.tolist()):
            expert = block.experts[e]
            hidden = torch.nn.functional.silu(expert.gate_proj.weight @ token) * (expert.up_proj.weight @ token)
            out = out + weight * (expert.down_proj.weight @ hidden)
        rows.append(out)
        all_scores.append(scores)
        chosen_all.append(top)
    scores, chosen = torch.stack(all_scores), torch.stack(chosen_all)
    experts = scores.shape[-1]
    load = torch.zeros(experts)
    for e in chosen.flatten().tolist():
        load[e] += 1.0 / chosen.numel()
    aux = (load * scores.mean(0)).sum() * experts * block.aux_loss_coef if block.training else x.new_zeros(())
    return torch.stack(rows).view_as(x), aux


@pytest.mark.parametrize("train", [False, True])
def test_moe_golden_file_agrees_with_a_per_token_loop_over_the_experts(golden_moe, train, monkeypatch):
    """The MoE fixture checked against something independent: its logits (eval) and aux loss (training) with every
    MoE block replaced by the per-token loop above."""
    from minimind.model import MoEFeedForward

    monkeypatch.setattr(MoEFeedForward, "forward", per_token_moe)
    model = golden_model(golden_moe, train=train)
    with torch.no_grad():
        out = model(golden_moe["input_ids"], labels=golden_moe["input_ids"])
    if train:
        torch.testing.assert_close(out["aux_loss"], golden_moe["train_aux_loss"], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.loss, golden_moe["train_loss"], atol=ATOL, rtol=0)
    else:
        torch.testing.assert_close(out.logits, golden_moe["eval_logits"], atol=ATOL, rtol=0)


def test_state_dict_keys_are_exactly_the_reference(golden_dense, golden_moe):
    for golden in (golden_dense, golden_moe):
        model = golden_model(golden)
        assert list(sorted(model.state_dict())) == sorted(golden["state_dict"])


def reference_keys(layers: int, moe: bool, experts: int = 4) -> set[str]:
    """The key list of ../shared/reference/README.md, expanded."""
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(layers):
        p = f"model.layers.{i}"
        keys |= {f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        keys |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        if moe:
            keys.add(f"{p}.mlp.gate.weight")
            keys |= {f"{p}.mlp.experts.{e}.{n}.weight" for e in range(experts) for n in ("gate_proj", "up_proj", "down_proj")}
        else:
            keys |= {f"{p}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys


@pytest.mark.parametrize("moe, count", [(False, 63_912_192), (True, 198_416_640)])
def test_default_configs_parameter_counts_and_keys(moe, count):
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig(use_moe=moe))
    assert model.config.intermediate_size == 2432
    assert sum(p.numel() for p in model.parameters()) == count  # parameters() counts the tied weight once
    assert set(model.state_dict()) == reference_keys(8, moe)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def qwen3_twin(config: MiniMindConfig) -> Qwen3ForCausalLM:
    """The matching transformers Qwen3 model: an independent implementation of the same architecture."""
    qwen = Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu",
    )
    return Qwen3ForCausalLM(qwen).eval()


def test_same_logits_as_transformers_qwen3(golden_dense):
    model = golden_model(golden_dense)
    qwen = qwen3_twin(model.config)
    qwen.load_state_dict(golden_dense["state_dict"], strict=True)
    ids = golden_dense["input_ids"]
    torch.testing.assert_close(qwen(ids).logits, model(ids).logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(qwen(ids).logits, golden_dense["logits"], atol=ATOL, rtol=0)


def test_save_pretrained_round_trip_and_generate(golden_dense, tmp_path):
    model = golden_model(golden_dense)
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "minimind"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MiniMindForCausalLM)
    ids = golden_dense["input_ids"]
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.isfinite(loaded.model.rope_cos).all()
    prompt = ids[:1, :6]
    generated = loaded.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    greedy = prompt
    for _ in range(6):  # the same tokens without a KV cache
        greedy = torch.cat([greedy, model(greedy).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, greedy)


def test_rope_tables_recomputed_after_meta_init(golden_dense):
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig(**golden_dense["config"]))
    model.to_empty(device="cpu")
    model.load_state_dict(golden_dense["state_dict"], strict=True)
    model.model.reset_rope()
    logits = model.eval()(golden_dense["input_ids"]).logits
    torch.testing.assert_close(logits, golden_dense["logits"], atol=ATOL, rtol=0)


def test_yarn_only_when_requested():
    base = MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                          max_position_embeddings=4096)
    yarn = MiniMindConfig(**{**base.to_dict(), "inference_rope_scaling": True})
    plain, scaled = MiniMindForCausalLM(base).model.rope_cos, MiniMindForCausalLM(yarn).model.rope_cos
    assert torch.equal(plain[:, 0], scaled[:, 0])  # the fastest frequency is kept
    assert not torch.equal(plain[:, 7], scaled[:, 7])  # slow ones are interpolated


def test_model_package_knows_nothing_of_parallelism():
    files = sorted(Path(minimind.__file__).parent.glob("*.py"))  # the imported package, wherever pytest runs
    assert {"config.py", "model.py"} <= {f.name for f in files}, files
    source = "\n".join(p.read_text() for p in files)
    assert not re.search(r"torch\.distributed|get_rank|world_size|pp_rank|tp_rank|is_first|is_last", source)


def test_layers_are_keyed_by_global_id_so_pruning_keeps_names(golden_dense):
    model = golden_model(golden_dense)
    del model.model.layers["0"]
    assert "model.layers.1.mlp.up_proj.weight" in model.state_dict()
    assert not any(k.startswith("model.layers.0.") for k in model.state_dict())
