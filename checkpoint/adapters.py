"""LoRA adapters out as a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) or as MiniMind's LoRA
.pth, and MiniMind's LoRA .pth in as Sluice's adapters.

The folder is what PEFT's own `save_pretrained` writes for a LoRA model, so `PeftModel.from_pretrained(base, folder)`
loads it onto the base model: the dense weights the run started from (`checkpoint.load_dense`, also recorded as
`base_model_name_or_path`). Sluice names an adapter as PEFT does inside the model (`...q_proj.lora_A.weight`); the
file adds PEFT's wrapper prefix (`base_model.model.`). `target_modules` lists the adapted linears by full name,
which PEFT matches exactly.

MiniMind's `model/model_lora.py` gives every square `nn.Linear` (in == out) a child `lora` holding `A` [rank, in] and
`B` [out, rank], output `B(A(x))` (scale 1), and its `save_lora` / `load_lora` write and read `<linear>.lora.A.weight`
and `<linear>.lora.B.weight`, each linear's pair loaded strictly; its trainer and `eval_llm.py` call
`apply_lora(model)`, rank 16. Sluice's scale `alpha / rank` is folded into B on the way out and out of it on the way
in; a square linear Sluice did not adapt goes out as a zero pair (it adds nothing), and a rank below 16 is padded
with zero rows of A and columns of B (the product unchanged) so that MiniMind's default `apply_lora` takes the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from checkpoint.dense import load_weights_only
from checkpoint.errors import CheckpointError
from checkpoint.lora_merge import adapter_pairs, is_adapter

PEFT_PREFIX = "base_model.model."  # PeftModel wraps the LM in a LoraModel: its keys carry both attribute names
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MINIMIND_RANK = 16  # MiniMind's apply_lora(model, rank=16), as its train_lora.py and eval_llm.py call it
MINIMIND_A, MINIMIND_B = ".lora.A.weight", ".lora.B.weight"


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


def square_linears(model: nn.Module) -> list[str]:
    """The names of `model`'s square linears (in == out): the ones MiniMind's `apply_lora` adapts."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features == m.out_features]


def minimind_lora_path(model: nn.Module, out: str | Path) -> Path:
    """`out` itself when it names a .pth file, else MiniMind's `lora_<hidden>[_moe].pth` inside it."""
    out = Path(out)
    if out.suffix == ".pth":
        return out
    suffix = "_moe" if getattr(model.config, "use_moe", False) else ""
    return out / f"lora_{model.config.hidden_size}{suffix}.pth"


def minimind_lora_state(state: dict[str, torch.Tensor], record: dict[str, Any],
                        model: nn.Module) -> dict[str, torch.Tensor]:
    """A run's adapters in MiniMind's keys and scale, a pair for every square linear of `model` (see the module)."""
    pairs = adapter_pairs(state)
    squares = square_linears(model)
    odd = sorted(set(pairs) - set(squares))
    if odd:
        shape = "x".join(map(str, reversed(state[odd[0] + ".weight"].shape))) if odd[0] + ".weight" in state else "?"
        raise CheckpointError(f"--adapters-only --format pth: {odd[0]} ({shape}, in x out) has an adapter, and "
                              "MiniMind's apply_lora adapts square linears only; export a PEFT folder (--format hf) "
                              "or train with lora.targets=null")
    rank, scale = record["rank"], record["alpha"] / record["rank"]
    width = max(rank, MINIMIND_RANK)
    out = {}
    for name in squares:
        features = model.get_submodule(name).in_features
        a, b = torch.zeros(width, features), torch.zeros(features, width)
        if name in pairs:
            lora_a, lora_b = pairs[name]
            a[:rank] = lora_a.float()
            b[:, :rank] = (lora_b.double() * scale).float()
        out[name + MINIMIND_A], out[name + MINIMIND_B] = a, b
    return out


def save_minimind_lora(state: dict[str, torch.Tensor], record: dict[str, Any], model: nn.Module,
                       out: str | Path) -> Path:
    """Write a run's adapters as MiniMind's LoRA .pth (`load_lora(model, path)` after `apply_lora(model)`)."""
    path = minimind_lora_path(model, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(minimind_lora_state(state, record, model), path)
    return path


def read_minimind_lora(path: str | Path, rank: int, scale: float) -> dict[str, torch.Tensor]:
    """MiniMind's LoRA .pth as Sluice adapter weights (`<linear>.lora_A.weight`, `<linear>.lora_B.weight`) for a run
    of lora.rank `rank` and scale `scale` (= alpha / rank): B divided by the scale; a file of a larger rank whose
    extra components are zero (a padded export) is cut to `rank`. CheckpointError names what does not fit."""
    key = f"lora.init={path}"
    loaded = load_weights_only(Path(path))
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{key}: not a state_dict of tensors (MiniMind's save_lora writes one)")
    loaded = {k.removeprefix("module."): v for k, v in loaded.items()}  # as MiniMind's load_lora strips DDP's prefix
    linears = sorted({k[:-len(MINIMIND_A)] for k in loaded if k.endswith(MINIMIND_A)})
    if not linears or len(loaded) != 2 * len(linears) or any(n + MINIMIND_B not in loaded for n in linears):
        raise CheckpointError(f"{key}: holds no MiniMind LoRA pairs (<linear>.lora.A.weight and "
                              "<linear>.lora.B.weight for each adapted linear); give a file MiniMind's save_lora wrote")
    out = {}
    for name in linears:
        a, b = loaded[name + MINIMIND_A].float(), loaded[name + MINIMIND_B].float()
        have = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != have:
            raise CheckpointError(f"{key}: {name}'s A {tuple(a.shape)} and B {tuple(b.shape)} are not a LoRA pair")
        if have != rank and (have < rank or bool(a[rank:].any()) and bool(b[:, rank:].any())):
            raise CheckpointError(f"{key}: its adapters have rank {have}; set lora.rank={have}")
        out[f"{name}.lora_A.weight"] = a[:rank].contiguous()
        out[f"{name}.lora_B.weight"] = (b[:, :rank].double() / scale).float().contiguous()
    return out
