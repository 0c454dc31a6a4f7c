"""The `grpo` section of the run config (`train.task=grpo`), named after the arguments of MiniMind's train_grpo.py,
in a file of its own to keep schema.py short."""

from dataclasses import dataclass
from typing import Any, Optional

from training.rules.keys import ReadWhen, key
from training.rules.values import at_least, fraction, non_negative, one_of, optional, positive, text
from training.methods.grpo.rewards import RULES

GRPO_ONLY = ReadWhen("train.task", ("grpo",), refuse=True)
GRPO_SETTING = ReadWhen("train.task", ("grpo",), refuse=False)


def reward_entries(key_name: str, value: Any) -> Optional[str]:
    """A non-empty list whose entries are reward names or `{_target_: module.function, ...}` mappings."""
    entries = list(value or ())
    if not entries:
        return f"{key_name} is empty; give at least one reward, e.g. {key_name}=[minimind_rules]"
    for entry in entries:
        if isinstance(entry, str):
            if entry not in RULES:
                return (f"{key_name}: unknown reward {entry!r}; use one of {', '.join(RULES)} or a mapping with "
                        "_target_: module.function")
        elif not hasattr(entry, "get") or not isinstance(entry.get("_target_"), str):
            return f"{key_name}: entry {entry!r} is neither a reward name nor a mapping with _target_: module.function"
    return None


@dataclass
class GrpoSchema:
    """Group relative policy optimisation (`train.task=grpo`): sample, score, normalise in groups, train."""

    num_generations: int = key(6, "completions sampled per prompt, a group; `train.micro_batch_size` holds whole "
                                  "groups (MiniMind: 6)", at_least(2), GRPO_SETTING)
    max_new_tokens: int = key(64, "tokens generated per completion at most (MiniMind's `max_gen_len`); a prompt "
                                  "gets `train.seq_len - max_new_tokens` tokens, longer ones keep their end",
                              positive, GRPO_SETTING)
    temperature: float = key(0.8, "sampling temperature of the rollouts (`0`: greedy; MiniMind: 0.8)", non_negative,
                             GRPO_SETTING)
    top_p: float = key(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches `top_p`",
                       fraction(closed_top=True), GRPO_SETTING)
    thinking_ratio: float = key(0.9, "share of prompts rendered with an open `<think>` block (the chat template's "
                                     "`open_thinking`; drawn per prompt from `data.seed`; MiniMind: 0.9)",
                                fraction(closed_top=True), GRPO_SETTING)
    beta: float = key(0.1, "weight of the k3 KL penalty to the reference (the starting weights) per token "
                           "(MiniMind: 0.1)", non_negative, GRPO_SETTING)
    loss_type: str = key("cispo", "`grpo`: PPO's clipped ratio `min(r A, clip(r, 1-epsilon, 1+epsilon) A)`; `cispo`: "
                                  "`min(r, epsilon_high)` detached times `A log p` (MiniMind's default)",
                         one_of("grpo", "cispo"), GRPO_SETTING)
    epsilon: float = key(0.2, "the clip range of `loss_type=grpo` (MiniMind: 0.2)", positive, GRPO_SETTING)
    epsilon_high: float = key(5.0, "the ratio's cap under `loss_type=cispo` (MiniMind: 5.0)", positive, GRPO_SETTING)
    rewards: list[Any] = key(
        ["minimind_rules"], "rewards summed per completion: `minimind_rules` (MiniMind's length, think-block and "
        "repetition terms) or `{_target_: module.function, ...}`, a callable taking the prompts and the completions "
        "(strings) and returning one float per completion", reward_entries, GRPO_SETTING)
    reward_model: Optional[str] = key(
        None, "a local folder of a transformers sequence-classification model with the run's tokenizer: its score "
        "clipped to [-3, 3] joins the rewards (forward only, on the first rank of each DP replica)", optional(text),
        GRPO_ONLY)
    sample_every: int = key(10, "write sample completions with their rewards to `<run dir>/rollouts.jsonl` every N "
                                "steps (`0`: never)", at_least(0), GRPO_SETTING)
