"""The values of a model's config.json checked before any config or model is built from them.

transformers builds a model from whatever config.json holds: vocab_size -5 fails deep in `nn.Embedding`, 0 heads
divides by zero, an unknown activation or rope_type is a KeyError in the first layer. Each is one line here, naming
the field and the fix. The choices come from transformers' own tables (ACT2FN, ROPE_INIT_FUNCTIONS), so a type the
installed version adds is accepted without a change here. Only transformers is imported: scripts/generate.py uses
this module too.
"""

from __future__ import annotations

import math
from typing import Any

from models.model_size import size_problem

# Sizes a model allocates from: a positive integer (bool is an int to Python, not to a config).
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok",
         "moe_intermediate_size", "num_local_experts", "sliding_window")
# Sizes whose null means "derive it" (MiniMind's widths, transformers' key/value heads and head_dim) or "none"
# (Mistral's sliding window).
NULL_ALLOWED = ("intermediate_size", "num_key_value_heads", "head_dim", "moe_intermediate_size", "sliding_window")
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "initializer_range", "query_pre_attn_scalar")
ACTIVATIONS = ("hidden_act", "hidden_activation")  # Gemma 3 names it hidden_activation
ROPE_KEYS = ("rope_parameters", "rope_scaling")
MINIMIND_ACTIVATION = "silu"  # MiniMind's MLP runs SwiGLU whatever hidden_act says


def config_values_problem(data: dict[str, Any], where: str) -> str | None:
    """One line naming the first field of `data` (a config.json's fields) whose value no model can be built from,
    or None; `where` starts the line (e.g. "model.hf_config=FOLDER: config.json's")."""
    for name in SIZES:
        if name in data and not (data[name] is None and name in NULL_ALLOWED):
            value = data[name]
            if type(value) is not int or value <= 0:
                return f"{where} {name}={value!r} must be a positive integer; fix it in config.json"
    for name in POSITIVE_NUMBERS:
        value = data.get(name)
        if name in data and (type(value) not in (int, float) or not math.isfinite(value) or value <= 0):
            return f"{where} {name}={value!r} must be a finite number > 0; fix it in config.json"
    for name in ACTIVATIONS:
        if name in data and (problem := _activation_problem(name, data[name], data.get("model_type"))):
            return f"{where} {problem}"
    for name in ROPE_KEYS:
        if data.get(name) is not None and (problem := _rope_problem(name, data[name])):
            return f"{where} {problem}"
    if problem := _rope_disagreement(data):
        return f"{where} {problem}"
    return size_problem(data, where)  # before a config object is built: some make a list per layer


def _activation_problem(name: str, value: Any, model_type: str | None) -> str | None:
    """The activation is one of transformers' ACT2FN (MiniMind: silu, the only one its MLP runs)."""
    from transformers.activations import ACT2FN

    if model_type == "minimind":
        return None if value == MINIMIND_ACTIVATION else \
            f"{name}={value!r}: MiniMind's MLP runs {MINIMIND_ACTIVATION} only; set \"{name}\": \"silu\""
    if isinstance(value, str) and value in ACT2FN:
        return None
    return f"{name}={value!r} is not an activation transformers knows; use one of {', '.join(sorted(ACT2FN))}"


def _rope_problem(name: str, value: Any) -> str | None:
    """rope_parameters / rope_scaling: a dict (or one per attention type) whose rope_type transformers implements."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(value, dict):
        return f"{name}={value!r} must be an object such as {{\"rope_type\": \"default\", \"rope_theta\": 10000.0}}"
    nested = value and all(isinstance(v, dict) for v in value.values())  # per attention type (Gemma 3)
    for label, params in (((f"{name}.{k}", v) for k, v in value.items()) if nested else [(name, value)]):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default" and (not isinstance(rope_type, str) or rope_type not in ROPE_INIT_FUNCTIONS):
            choices = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
            return f"{label}: rope_type {rope_type!r} is not one transformers implements; use one of {choices}"
        theta = params.get("rope_theta")
        if "rope_theta" in params and (type(theta) not in (int, float) or not math.isfinite(theta) or theta <= 0):
            return f"{label}: rope_theta={theta!r} must be a finite number > 0"
    return None


def _rope_disagreement(data: dict[str, Any]) -> str | None:
    """A top-level rope_theta (what transformers 4 reads) that differs from rope_parameters' (what 5 reads)."""
    rope, theta = data.get("rope_parameters"), data.get("rope_theta")
    numbers = (int, float)
    if not isinstance(rope, dict) or type(theta) not in numbers or type(rope.get("rope_theta")) not in numbers:
        return None
    if math.isclose(theta, rope["rope_theta"], rel_tol=1e-9):
        return None
    return (f"rope_theta={theta!r} and rope_parameters.rope_theta={rope['rope_theta']!r} disagree (transformers 4 "
            "reads the first, 5 the second: one of them would run a wrong RoPE); set both to the trained value")
