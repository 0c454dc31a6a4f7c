"""The model families Sluice trains, and the way from a run's model section to a config, a model and a Decoder.

MiniMind is built from the section's fields; transformers' own Llama, Qwen3 and Qwen3-MoE from a `config.json`
(`model.hf_config`, the fields set in the section applied on top). Their classes run as installed, untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from minimind import MiniMindConfig, MiniMindForCausalLM
from models.config_values import config_values_problem
from models.model_size import size_problem
from models.registry import ADAPTERS
from parallel.decoder import ContractError, Decoder, DecoderPlan

ROOT = Path(__file__).resolve().parent.parent  # presets name their config.json relative to the repository
SUPPORTED = ", ".join(ADAPTERS)
MINIMIND_ONLY = ("dropout", "use_moe")  # MiniMind's own switches; transformers' families take theirs from config.json
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef")


class ModelError(ValueError):
    """A model section that names no buildable model; one line naming the key and the fix."""


def hf_config_folder(value: str) -> Path:
    """`model.hf_config` as a folder: relative to the working directory, else to the repository (presets)."""
    path = Path(value)
    if not path.is_absolute() and not path.exists() and (ROOT / path).exists():
        path = ROOT / path
    if not (path / "config.json").is_file():
        raise ModelError(f"model.hf_config={value} has no config.json; give a folder written by save_pretrained "
                         "(or one holding a transformers config.json)")
    return path


def model_config(section: dict[str, Any]) -> PretrainedConfig:
    """The transformers config of a run's model section (`name` is the preset; null fields keep the default)."""
    fields = {k: v for k, v in section.items() if k != "name"}
    folder = fields.pop("hf_config", None)
    given = {k: v for k, v in fields.items() if v is not None}
    if folder is None:
        _check_minimind_fields(given)
        if problem := size_problem(given, "model:"):  # closed form: num_hidden_layers=1e9 must not build
            raise ModelError(problem)
        return MiniMindConfig(**given)
    path = hf_config_folder(folder)
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: arrays nested past Python's stack
        raise ModelError(f"model.hf_config={folder}: config.json is not readable JSON ({type(error).__name__})") \
            from None
    if not isinstance(data, dict):
        raise ModelError(f"model.hf_config={folder}: config.json holds {type(data).__name__}, not an object of fields")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in ADAPTERS:
        raise ModelError(_unsupported(folder, model_type if isinstance(model_type, str) else None))
    if problem := config_values_problem({**data, **given}, f"model.hf_config={folder}: config.json's"):
        raise ModelError(problem)
    if model_type == "minimind":  # MiniMindConfig writes every MoE field: only the overrides are checked
        _check_minimind_fields(given, bool({**data, **given}.get("use_moe", False)))
        return _built(f"model.hf_config={folder}: config.json's", lambda: MiniMindConfig(**{**_plain(data), **given}),
                      "config.json")
    default = AutoConfig.for_model(model_type)
    for key in given:
        if key in MINIMIND_ONLY or not hasattr(default, key):
            raise ModelError(f"model.{key} does not apply to {model_type} models; set it in model.hf_config's "
                             "config.json or drop the override")
    if "rope_theta" in given and isinstance(data.get("rope_parameters"), dict):
        data["rope_parameters"] = {**data["rope_parameters"], "rope_theta": given.pop("rope_theta")}
    return _built(f"model.hf_config={folder}: config.json's",
                  lambda: AutoConfig.for_model(model_type, **{**_plain(data), **given}), "config.json")


def _built(where: str, make, file: str):
    """`make()`, a config object; what its constructor refuses (transformers' own checks of the fields config_values
    leaves alone: layer_types, a rope field's type) is one ModelError line naming `where` and the `file` to fix."""
    try:
        return make()
    except (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        detail = (lines[-1].partition(": ")[2] or lines[-1]).lower() if isinstance(error, StrictDataclassError) \
            else lines[0]
        raise ModelError(f"{where} {detail[:300]}; fix it in {file}") from None


def _plain(data: dict) -> dict:
    """config.json's fields as constructor keywords (without the class's own bookkeeping keys)."""
    return {k: v for k, v in data.items() if k not in ("model_type", "architectures", "transformers_version",
                                                         "auto_map", "dtype", "torch_dtype")}


def _unsupported(folder: str, model_type: str | None) -> str:
    """One line: what the folder holds and what Sluice trains."""
    if model_type is None:
        return f"model.hf_config={folder}: config.json has no model_type; Sluice trains {SUPPORTED}"
    try:
        config = AutoConfig.for_model(model_type)
        declared = "declares a pipeline plan" if getattr(config, "base_model_pp_plan", None) else \
            "declares no pipeline plan (base_model_pp_plan)"
    except (ValueError, KeyError):
        declared = "is unknown to the installed transformers"
    return (f"model.hf_config={folder}: model_type {model_type!r} {declared} and has no Sluice adapter; "
            f"Sluice trains {SUPPORTED}")


def _check_minimind_fields(fields: dict[str, Any], use_moe: bool | None = None) -> None:
    """MoE keys are read only when use_moe is on (setting one on a dense model would be silently ignored)."""
    use_moe = bool(fields.get("use_moe", False)) if use_moe is None else use_moe
    for key in MOE_KEYS:
        if not use_moe and key in fields:
            raise ModelError(f"model.{key}={fields[key]} is read only when model.use_moe=True (here "
                             f"model.use_moe={use_moe}); drop model.{key} or change model.use_moe")


# to_dict() keys that say nothing about the model's shape or numbers (bookkeeping, output switches).
NOT_MODEL = {"_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "auto_map",
             "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
             "chunk_size_feed_forward", "is_encoder_decoder"}


def config_record(config: PretrainedConfig) -> dict[str, Any]:
    """The config as plain JSON (what a checkpoint records, compares on resume and rebuilds the model from)."""
    return {k: v for k, v in config.to_dict().items() if k not in NOT_MODEL}


def config_from_record(record: dict[str, Any], where: str = "a checkpoint's meta.json model") -> PretrainedConfig:
    """The config `config_record` wrote, its values checked first (`where` names the file in the one line)."""
    if problem := config_values_problem(record, where):
        raise ModelError(problem)
    fields = {k: v for k, v in record.items() if k != "model_type"}
    model_type = record.get("model_type", "minimind")
    if model_type == "minimind":
        return _built(where, lambda: MiniMindConfig(**fields), "meta.json")
    if not isinstance(model_type, str) or model_type not in ADAPTERS:
        raise ModelError(_unsupported(where, model_type if isinstance(model_type, str) else None))
    return _built(where, lambda: AutoConfig.for_model(model_type, **fields), "meta.json")


def family_of(config: PretrainedConfig) -> str:
    """The config's family (its model_type); ModelError where Sluice has no adapter for it."""
    if config.model_type not in ADAPTERS:
        raise ModelError(_unsupported(getattr(config, "_name_or_path", "") or "?", config.model_type))
    return config.model_type


def native(config: PretrainedConfig) -> bool:
    """True for transformers' own classes: an exported folder loads without trust_remote_code."""
    return family_of(config) != "minimind"


def build_model(config: PretrainedConfig, device: str | torch.device = "meta") -> nn.Module:
    """The dense causal LM of `config` on `device` (meta: shapes only, no memory), attention through SDPA."""
    family_of(config)
    with torch.device(device):
        if isinstance(config, MiniMindConfig):
            model = MiniMindForCausalLM(config)
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model


def decoder_of(model: nn.Module) -> Decoder:
    """`model` as the parallel layer sees it: its declared plans (the TP plan as its adapter chooses) and its
    family's adapter."""
    family = ADAPTERS[family_of(model.config)]
    try:
        adapter = family(model)
        return Decoder(model, DecoderPlan.of(model, adapter), adapter)
    except ContractError as error:
        raise ModelError(str(error)) from None
