"""Distillation's teacher (`distill.teacher`): found, checked and loaded whole on a rank, frozen, forward only.

The teacher is an HF folder (a config.json beside its weights: save_pretrained, `scripts/export_hf.py`), a MiniMind
`.pth` (its config read from its shapes, `checkpoint.pth_config`) or a Sluice training checkpoint (a checkpoint, a
checkpoints folder or a run directory, LoRA adapters merged); it may have
another size than the student, and at least the student's vocabulary (MiniMind cuts its logits to the student's).
"""

import logging
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from checkpoint.errors import CheckpointError
from parallel.decoder import Decoder
from parallel.grid import ParallelGrid
from parallel.spec import EngineSpec
from parallel.step import MicroBatch
from training.methods.distill.objective import TOKENS, DistillLoss
from models import ModelError, config_from_record, model_config, build_model, decoder_of
from models.model_size import host_memory, size_problem
from checkpoint.dense import read_dense_state_dict, check_dense_files
from checkpoint.pth_config import pth_config
from checkpoint.export import locate, build_model as checkpoint_model, read_merged_weights
from checkpoint.manager import read_meta, find_checkpoint
from training.data import DataError, run_data_spec
from training.data.tokenizer import weights_tokenizer_problem
from checkpoint.distributed import read_metadata
from checkpoint.dense_source import dense_source
from parallel.materialize import materialize_

log = logging.getLogger("sluice")


def is_pth(path: str) -> bool:
    """A MiniMind .pth file (`checkpoint.export_pth`'s `full_sft_768.pth`, MiniMind's own): its config is inferred."""
    return Path(path).suffix == ".pth" and Path(path).is_file()


def teacher_config(path: str):
    """The teacher's transformers config: its folder's config.json, or its training checkpoint's model record."""
    if (Path(path) / "config.json").is_file():
        config = model_config({"hf_config": path})  # its values and dimensions checked before it is built
    elif is_pth(path):
        config = pth_config(read_dense_state_dict(path), f"distill.teacher={path}")  # sizes from the shapes
    else:
        config = config_from_record(read_meta(locate(path))["model"], f"distill.teacher={path}: meta.json's model")
    # The teacher is built whole in each process (load_teacher): its weights must fit this host.
    if problem := size_problem(config.to_dict(), f"distill.teacher={path}:", host_memory()):
        raise ModelError(problem)
    return config


def teacher_problem(cfg: DictConfig, student_vocab: int) -> str | None:
    """Why this run's teacher cannot teach (one line, before launch), or None: none given under train.task=distill,
    no model at the path, unreadable weights, a vocabulary smaller than the student's, or a tokenizer of other ids."""
    path = OmegaConf.select(cfg, "distill.teacher")
    if OmegaConf.select(cfg, "train.task") != "distill":
        return None
    if path is None:
        return ("train.task=distill needs a teacher: set distill.teacher=<an HF folder (save_pretrained, "
                "scripts/export_hf.py) or a Sluice run directory or checkpoint>")

    folder = Path(path)
    if not folder.exists():
        return (f"distill.teacher={path} does not exist; give an HF folder (save_pretrained, scripts/export_hf.py) or "
                "a Sluice run directory or checkpoint")
    if not (folder / "config.json").is_file() and not is_pth(path) and \
            (not folder.is_dir() or find_checkpoint(folder) is None):
        return (f"distill.teacher={path} is neither an HF folder (no config.json), a MiniMind .pth nor a Sluice "
                "training checkpoint; give a folder written by save_pretrained or scripts/export_hf.py, a .pth or a "
                "run directory")
    try:
        if (folder / "config.json").is_file() or is_pth(path):
            check_dense_files(path)  # inside its folder, regular files: a FIFO would block every rank
        else:
            read_metadata(locate(path))  # its shards inside it, regular files (a link to /dev/zero), before launch
        vocab = teacher_config(path).vocab_size
    except (CheckpointError, ModelError) as error:
        line = str(error).strip().splitlines()[0].replace("checkpoint.load_dense=", "distill.teacher=")
        return line if line.startswith("distill.teacher=") else f"distill.teacher={path}: {line}"
    if vocab < student_vocab:
        return (f"distill.teacher={path} has a vocabulary of {vocab} tokens, the student {student_vocab}; the "
                "teacher's logits must cover the student's vocabulary (a teacher of the same tokenizer)")

    try:  # a teacher of another tokenizer teaches other words under the same ids, without any error
        problem = weights_tokenizer_problem(path, run_data_spec(cfg))
    except DataError as error:
        problem = str(error)
    return problem.replace("checkpoint.load_dense=", "distill.teacher=") if problem else None


def load_teacher(path: str, device: torch.device) -> Decoder:
    """The teacher, whole on `device`, in eval mode with no parameter requiring a gradient."""
    if (Path(path) / "config.json").is_file() or is_pth(path):
        teacher = decoder_of(build_model(teacher_config(path)))
        expected = {name: tuple(t.shape) for name, t in teacher.module.state_dict().items()}
        materialize_(teacher, dense_source(path, expected, teacher.plan.ties, teacher.config.model_type), 0, 1, device)
    else:
        state, meta = read_merged_weights(path)
        teacher = decoder_of(checkpoint_model(meta["model"], state).to(device))
    teacher.module.eval().requires_grad_(False)
    return teacher


def distill_objective(cfg: DictConfig, grid: ParallelGrid) -> DistillLoss:
    """The run's distillation loss with its teacher loaded on this rank (said on global rank 0 first)."""
    path = str(cfg.distill.teacher)
    if grid.rank == 0:
        log.info("distill: loading the teacher %s (forward only, on every rank); step 1 follows", path)
    teacher = load_teacher(path, grid.device)
    if grid.rank == 0:
        count = sum(p.numel() for p in teacher.module.parameters())
        log.info("distill: teacher %s, %.2fM parameters, alpha %g, temperature %g", teacher.config.model_type,
                 count / 1e6, cfg.distill.alpha, cfg.distill.temperature)
    return DistillLoss(teacher, float(cfg.distill.alpha), float(cfg.distill.temperature),
                       grid.tp_group if grid.tp > 1 else None, grid.tp_rank)


def with_teacher(spec: EngineSpec, cfg: DictConfig, grid: ParallelGrid) -> EngineSpec:
    """The engine spec with the distillation loss as its objective under train.task=distill, else unchanged."""
    if OmegaConf.select(cfg, "train.task") != "distill":
        return spec
    return replace(spec, objective=distill_objective(cfg, grid))


def with_inputs(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches with their token ids in the payload, where the last stage's teacher reads them."""
    return [replace(mb, extra={**mb.extra, TOKENS: mb.input_ids}) for mb in micro_batches]
