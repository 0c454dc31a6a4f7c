"""The model families Sluice trains: one entry per model_type, its adapter and its tiny presets.

Everything that lists families reads this table: the error naming what Sluice trains, the docs' list and the tests
(`tests/test_conformance.py` proves every entry's presets against the family's own transformers class: logits, loss,
gradients, buffers, initial values; `tests/test_families.py` trains them under the layouts). Adding a family is one
entry here, its presets (`models/configs/<preset>/config.json`, `conf/model/<preset>.yaml`) and, where a plan cannot
say something, its adapter.

Registering checks only what costs nothing (this module loads in every process): the adapter implements every hook
of `parallel.decoder.FamilyAdapter`, each preset exists and names the entry's model_type, and every TP style the
family's plans name (its config class's `base_model_tp_plan`, its LM class's `_tp_plan`, and the plan its adapter
chooses instead) is an entry of `parallel.tensor_styles.STYLES`: read from the classes, no model built. Whatever
needs a built model (its plans, buffers, TP subclasses, numbers) is the conformance test's, generated from this
table: a family that fails it fails the suite, not a user's run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from models.gemma3 import Gemma3Adapter
from models.minimind import MiniMindAdapter
from models.phi3 import Phi3Adapter
from models.transformers_decoder import TransformersDecoderAdapter
from parallel.decoder import FamilyAdapter
from parallel.tensor_styles import unknown_styles

ROOT = Path(__file__).resolve().parent.parent
HOOKS = tuple(name for name in vars(FamilyAdapter) if not name.startswith("_"))  # every method the protocol declares


@dataclass(frozen=True)
class Family:
    """A model_type Sluice trains: the adapter of what its plans cannot say, and `conf/model` presets of it at a
    CPU-friendly size (the conformance test's and the docs' examples)."""

    model_type: str
    name: str  # as the docs call it
    adapter: type
    presets: tuple[str, ...]


class RegistryError(TypeError):
    """A family entry that cannot be registered; the message names the entry and what is missing."""


def _preset_model_type(preset: str) -> str:
    """The model_type a `conf/model` preset builds: its hf_config folder's, else MiniMind (fields in the section)."""
    path = ROOT / "conf" / "model" / f"{preset}.yaml"
    if not path.is_file():
        raise RegistryError(f"preset {preset!r}: conf/model/{preset}.yaml does not exist")
    folder = (yaml.safe_load(path.read_text()) or {}).get("hf_config")
    if folder is None:
        return "minimind"
    return json.loads((ROOT / folder / "config.json").read_text()).get("model_type")


def declared_tp_plans(model_type: str) -> dict[str, dict[str, str]]:
    """The TP plans a model_type's classes declare, read from the classes (no model built): where -> plan."""
    config_class = type(AutoConfig.for_model(model_type))
    if config_class not in AutoModelForCausalLM._model_mapping:  # transformers' own lookup, registered ones too
        raise RegistryError(f"family {model_type!r}: transformers has no causal-LM class for it; register one with "
                            "AutoModelForCausalLM")
    lm_class = AutoModelForCausalLM._model_mapping[config_class]
    return {"base_model_tp_plan": dict(getattr(config_class, "base_model_tp_plan", None) or {}),
            "_tp_plan": dict(getattr(lm_class, "_tp_plan", None) or {})}


def _style_problem(family: Family) -> str | None:
    """One line naming family, module and style for the first style its plans name that Sluice's table lacks."""
    plans = declared_tp_plans(family.model_type)
    plans[f"{family.adapter.__name__}.tp_plan"] = family.adapter.tp_plan(plans["base_model_tp_plan"])
    for where, plan in plans.items():
        for key, style in unknown_styles(plan):
            return (f"family {family.model_type!r}: {key} declares TP style {style!r} ({where}), which Sluice's TP "
                    "style table lacks; add its builder to parallel/tensor_styles.py STYLES or choose a known style "
                    "in the adapter's tp_plan")
    return None


def registry(*families: Family) -> MappingProxyType:
    """The read-only table {model_type: Family}, each entry checked as the module docstring says."""
    table = {}
    for family in families:
        missing = [hook for hook in HOOKS if not callable(getattr(family.adapter, hook, None))]
        if missing:
            raise RegistryError(f"family {family.model_type!r}: {family.adapter.__name__} lacks the FamilyAdapter "
                                f"hooks {', '.join(missing)}")
        for preset in family.presets:
            if (found := _preset_model_type(preset)) != family.model_type:
                raise RegistryError(f"family {family.model_type!r}: preset {preset!r} builds {found!r}")
        if problem := _style_problem(family):
            raise RegistryError(problem)
        table[family.model_type] = family
    return MappingProxyType(table)


FAMILIES = registry(
    Family("minimind", "MiniMind", MiniMindAdapter, ("tiny", "tiny-moe")),
    Family("llama", "Llama", TransformersDecoderAdapter, ("llama-tiny",)),
    Family("qwen3", "Qwen3", TransformersDecoderAdapter, ("qwen3-tiny",)),
    Family("qwen3_moe", "Qwen3-MoE", TransformersDecoderAdapter, ("qwen3-moe-tiny",)),
    Family("mistral", "Mistral", TransformersDecoderAdapter, ("mistral-tiny",)),
    Family("gemma3_text", "Gemma3 (text)", Gemma3Adapter, ("gemma3-tiny",)),
    Family("phi3", "Phi-3", Phi3Adapter, ("phi3-tiny",)),
    Family("olmo2", "OLMo2", TransformersDecoderAdapter, ("olmo2-tiny",)),
)
ADAPTERS = MappingProxyType({model_type: family.adapter for model_type, family in FAMILIES.items()})
