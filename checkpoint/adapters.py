"""LoRA adapters out as a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) or as MiniMind's LoRA
.pth, and either in as the adapters a run starts from (`lora.init`).

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
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from checkpoint.atomic_write import output_folder, replace_folder, save_torch, write_text
from checkpoint.confine import inside, regular_file
from checkpoint.dense import load_weights_only
from checkpoint.errors import CheckpointError
from checkpoint.lora_merge import adapter_pairs, is_adapter

PEFT_PREFIX = "base_model.model."  # PeftModel wraps the LM in a LoraModel: its keys carry both attribute names
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MINIMIND_RANK = 16  # MiniMind's apply_lora(model, rank=16), as its train_lora.py and eval_llm.py call it
MINIMIND_A, MINIMIND_B = ".lora.A.weight", ".lora.B.weight"
SLUICE_A, SLUICE_B = ".lora_A.weight", ".lora_B.weight"  # PEFT's names, inside the model


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
    weights = {PEFT_PREFIX + name: tensor.detach().contiguous() for name, tensor in state.items() if is_adapter(name)}
    config = adapter_config(record, list(adapter_pairs(state)))

    def build(new: Path) -> None:  # a fresh folder, renamed into place whole
        save_file(weights, str(new / WEIGHTS), metadata={"format": "pt"})
        write_text(new / CONFIG, json.dumps(config, indent=2) + "\n", "export")

    replace_folder(out, build, "export")
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
    output_folder(path.parent, "export")
    save_torch(minimind_lora_state(state, record, model), path, "export")
    return path


def read_minimind_lora(path: str | Path, rank: int, scale: float) -> dict[str, torch.Tensor]:
    """MiniMind's LoRA .pth as Sluice adapter weights (`<linear>.lora_A.weight`, `<linear>.lora_B.weight`) for a run
    of lora.rank `rank` and scale `scale` (= alpha / rank): B divided by the scale; a file of a larger rank whose
    extra components are zero (a padded export) is cut to `rank`. CheckpointError names what does not fit."""
    key = f"lora.init={path}"
    regular_file(path, key)  # stat first: a FIFO would block the read forever
    try:
        loaded = load_weights_only(Path(path))
    except CheckpointError:
        raise
    except EOFError:
        raise CheckpointError(f"{key}: the file is empty or cut short; give a file MiniMind's save_lora "
                              "wrote") from None
    except Exception as error:  # a zip or pickle torch cannot parse: its own words, on one line
        detail = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise CheckpointError(f"{key}: cannot be read as a state_dict ({detail}); give a file MiniMind's save_lora "
                              "wrote") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in loaded.items()):
        odd = next((k for k in loaded if not isinstance(k, str)), None) if isinstance(loaded, dict) else None
        named = f" (a key is {type(odd).__name__} {odd!r}, not a name)" if odd is not None else ""
        raise CheckpointError(f"{key}: not a state_dict of tensors under string names{named}; give a file "
                              "MiniMind's save_lora wrote")
    loaded = {k.removeprefix("module."): v for k, v in loaded.items()}  # as MiniMind's load_lora strips DDP's prefix
    linears = sorted({k[:-len(MINIMIND_A)] for k in loaded if k.endswith(MINIMIND_A)})
    if not linears or len(loaded) != 2 * len(linears) or any(n + MINIMIND_B not in loaded for n in linears):
        raise CheckpointError(f"{key}: holds no MiniMind LoRA pairs (<linear>.lora.A.weight and "
                              "<linear>.lora.B.weight for each adapted linear); give a file MiniMind's save_lora wrote")
    pairs = {name: (loaded[name + MINIMIND_A], loaded[name + MINIMIND_B]) for name in linears}
    return sluice_pairs(key, pairs, rank, 1.0, scale)


def read_peft_lora(folder: str | Path, rank: int, scale: float) -> dict[str, torch.Tensor]:
    """A PEFT LoRA folder (what `save_adapters` and PEFT's `save_pretrained` write) as Sluice adapter weights for a
    run of lora.rank `rank` and scale `scale`: B rescaled from the folder's `lora_alpha / r` to the run's."""
    key = f"lora.init={folder}"
    if not any((Path(folder) / name).exists() for name in (CONFIG, WEIGHTS)):
        raise CheckpointError(f"{key}: a folder without {CONFIG} and {WEIGHTS}; give a PEFT adapter folder "
                              "(scripts/export_hf.py RUN OUT --adapters-only writes one) or a MiniMind LoRA .pth")
    config_path, weights_path = (inside(folder, name, key) for name in (CONFIG, WEIGHTS))
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        detail = "nested too deeply" if isinstance(error, RecursionError) else error
        raise CheckpointError(f"{key}: {CONFIG} is not JSON ({detail}); give a folder PEFT's save_pretrained "
                              "wrote") from None
    r, alpha = (config.get(k) if isinstance(config, dict) else None for k in ("r", "lora_alpha"))
    if type(r) is not int or r < 1 or type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise CheckpointError(f"{key}: {CONFIG} needs r a positive integer and lora_alpha a finite number > 0 (here "
                              f"r={r!r}, lora_alpha={alpha!r}); give a folder PEFT's save_pretrained wrote")
    if config.get("use_rslora") or config.get("use_dora"):
        raise CheckpointError(f"{key}: rsLoRA / DoRA adapters are not plain LoRA; give a plain LoRA folder")
    try:
        loaded = load_file(str(weights_path))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"{key}: {WEIGHTS} cannot be read ({error})") from None
    names = {k.removeprefix(PEFT_PREFIX): v for k, v in loaded.items()}
    linears = sorted({k[:-len(SLUICE_A)] for k in names if k.endswith(SLUICE_A)})
    if not linears or len(names) != 2 * len(linears) or any(n + SLUICE_B not in names for n in linears):
        raise CheckpointError(f"{key}: {WEIGHTS} holds no LoRA pairs (<linear>.lora_A.weight and "
                              "<linear>.lora_B.weight for each adapted linear, nothing else)")
    pairs = {name: (names[name + SLUICE_A], names[name + SLUICE_B]) for name in linears}
    return sluice_pairs(key, pairs, rank, alpha / r, scale)


def read_lora_init(path: str | Path, rank: int, scale: float) -> dict[str, torch.Tensor]:
    """lora.init's adapters: a PEFT folder, else MiniMind's LoRA .pth (see the two readers)."""
    if Path(path).is_dir():
        return read_peft_lora(path, rank, scale)
    return read_minimind_lora(path, rank, scale)


def sluice_pairs(key: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, file_scale: float,
                 scale: float) -> dict[str, torch.Tensor]:
    """Linear -> (A, B) of a file as Sluice's adapter weights of rank `rank`, B moved from the file's scale to the
    run's (the product B A x scale unchanged); zero extra
    components (a padded export) are cut, a real rank mismatch is refused naming the rank to set."""
    out = {}
    for name, (a, b) in pairs.items():
        a, b = a.float(), b.float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise CheckpointError(f"{key}: {name}'s A {tuple(a.shape)} and B {tuple(b.shape)} are not a LoRA pair")
        for side, tensor in (("A", a), ("B", b)):
            if not bool(torch.isfinite(tensor).all()):  # it would train as a non-finite loss at step 1
                raise CheckpointError(f"{key}: {name}'s {side} holds NaN or Inf; give adapters with finite values")
        have = a.shape[0]
        if have != rank and (have < rank or bool(a[rank:].any()) and bool(b[:, rank:].any())):
            raise CheckpointError(f"{key}: its adapters have rank {have}; set lora.rank={have}")
        out[f"{name}{SLUICE_A}"] = a[:rank].contiguous()
        out[f"{name}{SLUICE_B}"] = (b[:, :rank].double() * file_scale / scale).float().contiguous()
    return out
