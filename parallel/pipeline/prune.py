"""Build a stage module by pruning a copy of the dense model: the same classes, the same parameter names."""

import copy

from torch import nn


def prune_to_stage(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> nn.Module:
    """A deep copy of `model` (a MiniMindForCausalLM) keeping only `layers`, the embedding on the first
    stage and the final norm and `lm_head` on the last; every kept parameter keeps its dense name."""
    stage = copy.deepcopy(model)
    base = stage.model
    for layer_id in list(base.layers.keys()):
        if int(layer_id) not in layers:
            del base.layers[layer_id]
    if not is_first:
        base.embed_tokens = None
    if not is_last:
        base.norm = None
        stage.lm_head = None
    return stage
