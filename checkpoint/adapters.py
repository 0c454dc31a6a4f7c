"""LoRA adapters out as a PEFT folder: `adapter_config.json` + `adapter_model.safetensors`.

The folder is what PEFT's own `save_pretrained` writes for a LoRA model, so `PeftModel.from_pretrained(base, folder)`
loads it onto the base model: the dense weights the run started from (`checkpoint.load_dense`, also recorded as
`base_model_name_or_path`). Sluice names an adapter as PEFT does inside the model (`...q_proj.lora_A.weight`); the
file adds PEFT's wrapper prefix (`base_model.model.`). `target_modules` lists the adapted linears by full name,
which PEFT matches exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from parallel.lora import adapter_pairs, is_adapter

PEFT_PREFIX = "base_model.model."  # PeftModel wraps the LM in a LoraModel: its keys carry both attribute names
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def adapter_config(record: dict[str, Any], linears: list[str]) -> dict[str, Any]:
    """PEFT's LoraConfig fields for a run's LoRA record (rank, alpha, dropout, the base it started from)."""
    alpha = record["alpha"]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": record.get("base"),
            "r": record["rank"], "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "lora_dropout": record["dropout"], "target_modules": sorted(linears), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None, "layers_pattern": None, "revision": None}


def save_adapters(state: dict[str, torch.Tensor], record: dict[str, Any], out: str | Path) -> Path:
    """Write the adapters of a dense state_dict (and the config of `record`) as a PEFT folder `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {PEFT_PREFIX + name: tensor.detach().contiguous() for name, tensor in state.items() if is_adapter(name)}
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(record, list(adapter_pairs(state)))
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
