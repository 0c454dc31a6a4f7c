"""Stage weights as MiniMind writes them: `<out>/<stage>_<hidden>[_moe].pth`, a plain fp16 state_dict, at each save.

MiniMind's trainers write `out/pretrain_768.pth`, `out/full_sft_768.pth`, ... as they train (`lm_checkpoint`: every
key, tied head included, `.half()`), and the next stage starts from it (`--from_weight`). With
`checkpoint.export_pth=true` a run does the same beside its training checkpoints, so the next stage's
`checkpoint.load_dense` (or MiniMind's `--from_weight`) takes the file directly, with no export between stages. The file
is written from the complete training checkpoint just saved (the dense weights of every layout), under a temporary
name, renamed into place. A LoRA run writes its adapters merged into the base weights (what the next stage starts
from); `export_hf.py --adapters-only --format pth` writes MiniMind's adapter file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from checkpoint.export import build_model, read_merged_weights, save_pth
from checkpoint.stage_names import stage_name

OUT = "out"  # MiniMind's --save_dir, inside the run directory


def write_stage_weights(checkpoint: Path, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """`out_dir/<stage>_<hidden>[_moe].pth` from the complete training checkpoint `checkpoint`, in `dtype`."""
    state, meta = read_merged_weights(checkpoint)
    return save_pth(build_model(meta["model"], state), out_dir, stage_name(meta), dtype, what="checkpoint.export_pth")

