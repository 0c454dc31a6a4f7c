"""Exported folders that load on transformers 4.x and 5.x alike (MiniMind pins 4.57.6; Sluice runs 5.x).

transformers 5 writes RoPE as `rope_parameters` only; 4.x reads a top-level `rope_theta` (and `rope_scaling` for a
scaled RoPE) and, finding none, silently runs its default theta 10000. 5.x saves a tokenizer as `TokenizersBackend`
with `extra_special_tokens` as a list; 4.x knows no such class and reads `extra_special_tokens` as a dict of named
tokens. Both versions' fields are written here, with the same values, as MiniMind's own `convert_model.py` does by
hand; a tokenizer config 4.x already reads (MiniMind's own) is left exactly as it was written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from checkpoint.atomic_write import copy_file, write_text

BOTH_CLASS = "PreTrainedTokenizerFast"  # a class name both versions resolve (4.57 tokenization_auto.py:808)
FIVE_ONLY_CLASSES = ("TokenizersBackend",)  # what 5.x writes for a fast tokenizer; 4.57 raises "does not exist"
TOP_LEVEL = ("rope_theta", "partial_rotary_factor")  # 5.x moved these into rope_parameters; 4.x reads them on top
SPECIALS = ("bos_token", "eos_token", "pad_token")  # named in the config itself (none added at load)


def rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """transformers 4's reading of 5's `rope_parameters`: `rope_theta`, and `rope_scaling` (null for plain RoPE);
    Gemma 3's per-attention-type table as its `rope_theta` (full) and `rope_local_base_freq` (sliding)."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        out = rope_fields(rope.get("full_attention", {}))
        if "rope_theta" in rope.get("sliding_attention", {}):
            out["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        return out
    out = {k: rope[k] for k in TOP_LEVEL if k in rope}
    scaled = rope.get("rope_type", "default") != "default"
    out["rope_scaling"] = {k: v for k, v in rope.items() if k not in TOP_LEVEL} if scaled else None
    return out


def old_names(data: dict[str, Any]) -> dict[str, Any]:
    """The fields 5.x writes under a new name, under the name 4.x reads too (the config class's attribute_map, e.g.
    Qwen3-MoE's `num_local_experts`, which 4.57 reads as `num_experts`, silently defaulting to 128 experts)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        aliases = CONFIG_MAPPING[data.get("model_type")].attribute_map
    except KeyError:  # a family transformers does not know (MiniMind's own folder): its fields are its own
        return {}
    return {old: data[new] for old, new in aliases.items() if new in data and old not in data}


def config_for_both(data: dict[str, Any]) -> dict[str, Any]:
    """A config.json's fields with transformers 4's names added beside 5's, same values (5.x keeps reading its own):
    RoPE as `rope_theta` / `rope_scaling`, renamed fields under their old names."""
    rope = data.get("rope_parameters")
    return {**data, **old_names(data), **(rope_fields(rope) if isinstance(rope, dict) else {})}


def tokenizer_config_for_both(data: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer_config.json 4.x loads too: a class name it knows, `extra_special_tokens` as the dict it reads
    (5.x's list goes to `additional_special_tokens`, which both read); a config 4.x reads already is returned as is."""
    out = dict(data)
    if out.get("tokenizer_class") in FIVE_ONLY_CLASSES:
        out["tokenizer_class"] = BOTH_CLASS
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):
        out.setdefault("additional_special_tokens", extra)
        named = out.get("model_specific_special_tokens")
        out["extra_special_tokens"] = dict(named) if isinstance(named, dict) else {}
    return out


def make_portable(folder: Path) -> None:
    """Rewrite the config.json and tokenizer_config.json of a folder being built (its own new folder) for both
    transformers versions; a file that needs nothing is not touched."""
    for name, change in (("config.json", config_for_both), ("tokenizer_config.json", tokenizer_config_for_both)):
        path = folder / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        new = change(data)
        if new != data:
            write_text(path, json.dumps(new, indent=2, ensure_ascii=False) + "\n", "export")


def keep_written_config(tokenizer: Any, folder: Path) -> None:
    """After `save_pretrained(folder)`: the source folder's own tokenizer_config.json instead of 5.x's rewrite,
    where 4.x reads it as it is and it names its special tokens (MiniMind's): checkpoints and exports carry it as
    written."""
    source = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    path = source / "tokenizer_config.json"
    if not str(source) or path.is_symlink() or not path.is_file():
        return
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # the 5.x-saved config stays; make_portable fixes it at export
    if isinstance(data, dict) and all(data.get(k) for k in SPECIALS) and tokenizer_config_for_both(data) == data:
        copy_file(path, folder / "tokenizer_config.json", "checkpoint tokenizer")
