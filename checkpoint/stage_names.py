"""MiniMind's weight file names: `<stage>_<hidden>[_moe].pth`, the stage named as MiniMind's trainer of the task
names it (`--save_weight`: pretrain, full_sft, dpo, grpo, full_dist)."""

from __future__ import annotations

from typing import Any

# Sluice's train.task -> MiniMind's `--save_weight` default of the trainer that runs it.
STAGE_NAMES = {"pretrain": "pretrain", "sft": "full_sft", "dpo": "dpo", "grpo": "grpo", "distill": "full_dist"}
DEFAULT_STAGE = "pretrain"  # a checkpoint written before meta.json recorded its task


def stage_name(meta: dict[str, Any]) -> str:
    """MiniMind's weight prefix for the task a checkpoint's meta.json records."""
    return STAGE_NAMES.get(str(meta.get("task", DEFAULT_STAGE)), DEFAULT_STAGE)


def stage_file(name: str, config: Any) -> str:
    """MiniMind's file name: `<name>_<hidden>[_moe].pth`."""
    moe = getattr(config, "use_moe", None)
    moe = bool(getattr(config, "num_experts", 0)) if moe is None else moe
    return f"{name}_{config.hidden_size}{'_moe' if moe else ''}.pth"
