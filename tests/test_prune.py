"""Stage modules are the model's own classes, pruned, with dense parameter names."""

import pytest
import torch

from minimind import MiniMindConfig, MiniMindForCausalLM
from minimind.model import MiniMindModel
from models import decoder_of
from parallel.decoder import Decoder
from parallel.pipeline.partition import layer_partition


@pytest.mark.parametrize("num_layers, stages, explicit", [(4, 2, None), (5, 2, None), (5, 3, [1, 3, 1]), (4, 4, None)])
def test_stages_are_pruned_minimind_modules_with_dense_names(num_layers, stages, explicit):
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=256, max_position_embeddings=64))
    decoder = decoder_of(model)
    dense = model.state_dict()
    seen: set[str] = set()
    for s, layers in enumerate(layer_partition(num_layers, stages, explicit)):
        stage = decoder.prune(layers, s == 0, s == stages - 1)
        assert isinstance(stage, Decoder) and stage.module is not model
        assert isinstance(stage.module, MiniMindForCausalLM) and isinstance(stage.module.model, MiniMindModel)
        names = set(stage.module.state_dict())
        assert names <= set(dense)
        assert {int(k) for k in stage.module.model.layers.keys()} == set(layers)
        assert [i for i, _ in stage.blocks()] == list(layers)
        assert ("model.embed_tokens.weight" in names) == (s == 0)
        assert ("lm_head.weight" in names) == ("model.norm.weight" in names) == (s == stages - 1)
        for name, tensor in stage.module.state_dict().items():
            assert torch.equal(tensor, dense[name])
        seen |= names
    assert seen == set(dense)  # the stages together hold every dense parameter


def test_pruned_stages_chain_to_the_dense_forward():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=256, max_position_embeddings=64))
    ids = torch.randint(0, 256, (2, 16))
    decoder = decoder_of(model)
    first, last = (decoder.prune(r, s == 0, s == 1) for s, r in enumerate(layer_partition(4, 2)))
    hidden, _ = first(input_ids=ids)
    logits, _ = last(hidden=hidden)  # the last chunk ends in the head
    torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=1e-6)
