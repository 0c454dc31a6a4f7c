"""A trained model out: training checkpoint -> dense weights -> a self-contained HF folder or a MiniMind .pth.

Formats: `hf` (default) a folder of the stock transformers family that computes the model, loading without custom
code: transformers' own families as themselves, MiniMind as Qwen3 / Qwen3-MoE (`checkpoint.stock`, proven on the
weights before writing; MiniMind's own format where no stock family equals it, said in a warning); `minimind` a
folder carrying MiniMind's modeling files (`trust_remote_code=True`); `pth` a MiniMind state_dict file. A LoRA
checkpoint exports its adapters merged into the base weights (W + lora_B @ lora_A * alpha / rank), or,
`adapters_only`, as a PEFT folder (`hf`) or MiniMind's LoRA .pth (`pth`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torch import nn

import minimind
from checkpoint.adapters import save_adapters, save_minimind_lora
from checkpoint.atomic_write import copy_file, output_folder, replace_folder, save_torch
from checkpoint.checksums import check as verify_checksums
from checkpoint.compat import make_portable
from checkpoint.confine import files_inside
from checkpoint.dense import CheckpointError, fill_ties
from checkpoint.distributed import OPTIM, RNG, quiet_dcp, read_metadata
from checkpoint.safe_reader import SafeReader
from checkpoint.stage_names import DEFAULT_STAGE, stage_file, stage_name
from checkpoint.stock import stock_model
from checkpoint.manager import TOKENIZER, find_checkpoint, read_meta
from models import ModelError, build_model as build_module, config_from_record, native
from models.model_size import host_memory, size_problem
from parallel.decoder import DecoderPlan
from checkpoint.lora_merge import is_adapter, merge_adapters

# The model's own source files travel with the weights, so `trust_remote_code=True` needs no Sluice install.
MODELING_FILES = ("config.py", "model.py")
AUTO_MAP = {"AutoConfig": "config.MiniMindConfig", "AutoModelForCausalLM": "model.MiniMindForCausalLM"}
FORMATS = ("hf", "minimind", "pth")
log = logging.getLogger("sluice")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja")


def locate(path: str | Path) -> Path:
    """The training checkpoint at `path`: itself, the newest in a checkpoints folder, or in a run directory."""
    found = find_checkpoint(Path(path))
    if found is None:
        raise CheckpointError(f"{path} holds no complete training checkpoint (step_<N>/ with COMPLETE and meta.json); "
                              "pass a checkpoint, a checkpoints folder or a run directory")
    return found


def read_training_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The dense global-key weights (tied head restored) and meta.json of a training checkpoint, in one process."""
    folder = locate(path)
    verify_checksums(folder)  # a flipped byte is named, never exported
    meta = read_meta(folder)
    config = model_record_config(folder, meta["model"])  # sizes checked before anything is built or allocated
    metadata = read_metadata(folder)  # through the allow-list, or one clear line
    state = {key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for key, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and not key.startswith((OPTIM, RNG))}
    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=SafeReader(str(folder)), no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001  DCP wraps read failures (a BaseException)
        raise CheckpointError(f"checkpoint {folder} is corrupt or truncated ({type(error).__name__}); "
                              "export another checkpoint") from None
    fill_ties(state, DecoderPlan.of(build_module(config)).ties)  # meta: names only
    bad = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise CheckpointError(f"checkpoint {folder}: {bad[0]} holds NaN or Inf; refusing to export non-finite weights")
    return state, meta


def read_merged_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`read_training_weights` with a LoRA run's adapters merged into the weights they adapt (alpha / rank)."""
    state, meta = read_training_weights(path)
    if (lora := meta.get("lora")) is not None:
        state = merge_adapters(state, lora["alpha"] / lora["rank"])
    return state, meta


def model_record_config(folder: Path, record: dict[str, Any]):
    """The config of a checkpoint's model record, its values and size checked (the whole model is built in this
    process, in fp32: it must fit this host's memory); CheckpointError naming meta.json and the field."""
    where = f"checkpoint {folder}: meta.json's model"
    try:
        config = config_from_record(record, where)
    except ModelError as error:
        raise CheckpointError(str(error)) from None
    if problem := size_problem(record, where, host_memory()):
        raise CheckpointError(problem)
    return config


def build_model(record: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    """The dense model of a checkpoint's model record holding `state`, loaded strictly."""
    model = build_module(config_from_record(record), "cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not match its model config: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    return model.eval()


def tokenizer_files(source: Path, root: Path | None = None) -> list[Path]:
    """The tokenizer files in `source`, each a regular file inside `root` (default: `source` itself): a symlink that
    leaves it, a FIFO or a device is refused (stat only) before anything is copied or written."""
    root = source if root is None else root
    names = [str(source.relative_to(root) / name) for name in TOKENIZER_FILES]
    return files_inside(root, names, "tokenizer" if root == source else "checkpoint tokenizer")


def copy_tokenizer(files: list[Path], out_dir: Path) -> bool:
    """Copy the tokenizer `files` (checked by `tokenizer_files`) into `out_dir`, each confined (never through a link);
    False when there are none."""
    for file in files:
        copy_file(file, out_dir / file.name, "export")
    return bool(files)


def save_hf_folder(model: nn.Module, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                   root: str | Path | None = None, fmt: str = "hf") -> Path:
    """config.json, safetensors weights and (if given) the tokenizer, its files inside `root` (default: the
    tokenizer folder). A MiniMind model goes out as the stock family it equals (`fmt="hf"`, where one does) or with
    its modeling files and the auto_map that names them (`fmt="minimind"`)."""
    out_dir = Path(out_dir)
    tokenizer = [] if tokenizer_dir is None else \
        tokenizer_files(Path(tokenizer_dir), None if root is None else Path(root))  # refused before any write
    own = not native(model.config)
    if fmt == "minimind" and not own:
        raise CheckpointError(f"--format minimind: this is a {model.config.model_type} model, not MiniMind; use "
                              "--format hf (its own transformers family) or pth")
    if own and fmt == "hf":
        stock, why = stock_model(model)
        if stock is None:
            log.warning(f"export: {why}: writing MiniMind's own format (load it with trust_remote_code=True)")
        else:
            model, own = stock, False
    if own:
        model.config.auto_map = dict(AUTO_MAP)

    def build(new: Path) -> None:  # a fresh folder of its own: no file in it can be a link planted beforehand
        model.save_pretrained(str(new), safe_serialization=True)
        if own:
            source = Path(minimind.__file__).parent
            for name in MODELING_FILES:
                copy_file(source / name, new / name, "export")
        copy_tokenizer(tokenizer, new)
        make_portable(new)  # loads on transformers 4.x (MiniMind's pin) as on 5.x: rope_theta, tokenizer class

    replace_folder(out_dir, build, "export")  # renamed into place whole: a failed export leaves nothing
    return out_dir


def pth_path(model: nn.Module, out: str | Path, stage: str = DEFAULT_STAGE) -> Path:
    """`out` itself when it names a .pth file, else MiniMind's `<stage>_<hidden>[_moe].pth` inside it."""
    out = Path(out)
    return out if out.suffix == ".pth" else out / stage_file(stage, model.config)


PTH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # export_hf.py --pth-dtype


def save_pth(model: nn.Module, out: str | Path, stage: str = DEFAULT_STAGE, dtype: torch.dtype = torch.float16,
             what: str = "export") -> Path:
    """A plain state_dict file, every key present (tied head included), as MiniMind's loader expects; its floating
    tensors in `dtype` (fp16, as MiniMind saves them: half the bytes of fp32); `what` names the writer in errors."""
    path = pth_path(model, out, stage)
    output_folder(path.parent, what)
    weights = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).clone().contiguous()
               for k, v in model.state_dict().items()}
    save_torch(weights, path, what)
    return path


def export_checkpoint(path: str | Path, out: str | Path, fmt: str = "hf", adapters_only: bool = False,
                      pth_dtype: torch.dtype = torch.float16) -> Path:
    """Export the training checkpoint at `path` (or the newest in a run dir) as an HF folder (`hf`: the stock
    family, `minimind`: MiniMind's own code) or a .pth; a LoRA checkpoint's adapters merged into the weights, or alone
    (`adapters_only`) as a PEFT folder (`hf`) or MiniMind's LoRA .pth (`pth`); a `pth` model in `pth_dtype`."""
    if fmt not in FORMATS:
        raise CheckpointError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    if adapters_only:
        state, meta = read_training_weights(path)
        if (lora := meta.get("lora")) is None:
            raise CheckpointError(f"--adapters-only: checkpoint {locate(path)} was trained without LoRA (lora.rank=0) "
                                  "and holds no adapters; drop --adapters-only to export its weights")
        if fmt == "pth":
            base = build_model(meta["model"], {k: v for k, v in state.items() if not is_adapter(k)})
            return save_minimind_lora(state, lora, base, out)
        if fmt != "hf":
            raise CheckpointError(f"--adapters-only --format {fmt}: adapters go out as a PEFT folder (hf) or "
                                  "MiniMind's LoRA .pth (pth)")
        return save_adapters(state, lora, out)
    state, meta = read_merged_weights(path)
    model = build_model(meta["model"], state)
    if fmt == "pth":
        return save_pth(model, out, stage_name(meta), pth_dtype)  # by the run's task: full_sft_<hidden>.pth after SFT
    folder = locate(path)
    return save_hf_folder(model, out, folder / TOKENIZER, root=folder, fmt=fmt)  # a tokenizer link stays inside
