"""Dense checkpoints in every format load strictly, and mismatches say what is wrong."""

import pytest
import torch
from safetensors.torch import save_file

from checkpoint.dense import CheckpointError, load_dense_into, read_dense_state_dict
from minimind import MiniMindConfig, MiniMindForCausalLM

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=64)


def fresh(seed: int, **overrides) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig(**{**CONFIG, **overrides}))


@pytest.mark.parametrize("fmt", ["pth", "safetensors", "hf-folder"])
def test_every_format_loads_the_same_weights(tmp_path, fmt):
    source = fresh(1)
    if fmt == "pth":
        path = tmp_path / "pretrain_64.pth"
        torch.save({k: v.half() for k, v in source.state_dict().items()}, path)  # MiniMind saves fp16
    elif fmt == "safetensors":
        path = tmp_path / "model.safetensors"
        state = source.state_dict()
        state.pop("lm_head.weight")  # stored once, as transformers does for tied weights
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        path = tmp_path / "hf"
        source.save_pretrained(path)
    target = fresh(2)
    load_dense_into(target, path)
    tolerance = 1e-3 if fmt == "pth" else 0
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], tensor, rtol=tolerance, atol=tolerance)
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    state = fresh(1).state_dict()
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match=r"1 missing \(e.g. model.layers.1.mlp.up_proj.weight\); "
                                              r"1 unexpected \(e.g. model.layers.9.mlp.up_proj.weight\)"):
        load_dense_into(fresh(2), tmp_path / "bad.pth")


def test_shape_mismatch_names_the_tensor(tmp_path):
    torch.save(fresh(1, vocab_size=512).state_dict(), tmp_path / "wide.pth")
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight has shape \(512, 64\)"):
        load_dense_into(fresh(2), tmp_path / "wide.pth")


def test_not_a_state_dict(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="not a state_dict"):
        read_dense_state_dict(tmp_path / "list.pth")


def test_non_finite_weights_are_refused(tmp_path):
    state = fresh(1).state_dict()
    state["model.layers.0.self_attn.q_proj.weight"][1, 2] = float("nan")
    torch.save(state, tmp_path / "nan.pth")
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.q_proj.weight holds NaN or Inf"):
        load_dense_into(fresh(2), tmp_path / "nan.pth")
