"""GRPO's rewards: MiniMind's rule rewards by name, any callable by Hydra `_target_`, summed per completion.

The rules restate `calculate_rewards` and `rep_penalty` of MiniMind's trainer/train_grpo.py (jingyaogong/minimind):
the constants below are its ranges and rewards, `rule_reward` its arithmetic. A reward callable takes the prompts and
the completions (two lists of strings, one prompt per completion) and returns one float per completion.
"""

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
TOKEN = re.compile(r"\w+|[^\w\s]")
LENGTH_RANGE, LENGTH_REWARD = (20, 800), 0.5
THINK_END, THINK_RANGE, THINK_REWARD, THINK_PENALTY = "</think>", (20, 300), 1.0, -0.5
THINK_ONCE = 0.25
REPEAT_N, REPEAT_CAP = 3, 0.5


class RewardError(ValueError):
    """A reward that raised or returned the wrong shape; the message names the reward and the step."""


def repetition_penalty(text: str, n: int = REPEAT_N, cap: float = REPEAT_CAP) -> float:
    """The share of repeated n-grams of `text`'s tokens, times 2 * cap, capped at `cap` (0 without an n-gram)."""
    tokens = TOKEN.findall(text.lower())
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams))


def rule_reward(completion: str) -> float:
    """MiniMind's rule reward of one completion: length, think block, repetition."""
    low, high = LENGTH_RANGE
    reward = LENGTH_REWARD if low <= len(completion.strip()) <= high else -LENGTH_REWARD
    answer = completion
    if THINK_END in completion:
        thinking, rest = completion.split(THINK_END, 1)
        low, high = THINK_RANGE
        reward += THINK_REWARD if low <= len(thinking.strip()) <= high else THINK_PENALTY
        reward += THINK_ONCE if completion.count(THINK_END) == 1 else -THINK_ONCE
        answer = rest.strip()
    return reward - repetition_penalty(answer)


def minimind_rules(prompts: list[str], completions: list[str]) -> list[float]:
    """MiniMind's rule rewards (the prompts are not read)."""
    return [rule_reward(c) for c in completions]


RULES: dict[str, RewardFn] = {"minimind_rules": minimind_rules}


def reward_name(entry: Any) -> str:
    """How messages name a reward entry: its name, or its `_target_`."""
    return entry if isinstance(entry, str) else str(entry["_target_"])


def reward_function(entry: Any) -> RewardFn:
    """A `grpo.rewards` entry as a callable: a rule by name, or its `_target_` with the entry's other keys bound."""
    if isinstance(entry, str):
        return RULES[entry]
    from functools import partial

    from hydra.utils import get_method
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(entry, resolve=True) if not isinstance(entry, dict) else dict(entry)
    target = options.pop("_target_")
    try:
        function = get_method(target)
    except Exception as error:  # hydra wraps import errors of any kind
        raise RewardError(f"grpo.rewards: cannot import {target} ({str(error).splitlines()[0]}); give an "
                          "importable module.function") from None
    return partial(function, **options) if options else function


def score(functions: dict[str, RewardFn], prompts: list[str], completions: list[str], step: int) -> list[float]:
    """The summed rewards of each completion (its prompt beside it); a reward that raises, returns another count of
    values or a non-finite one -> RewardError naming it and the step."""
    totals = [0.0] * len(completions)
    for name, function in functions.items():
        try:
            values = list(function(list(prompts), list(completions)))
        except Exception as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise RewardError(f"grpo.rewards: {name} raised {type(error).__name__} at step {step}: {first}") from None
        if len(values) != len(completions):
            raise RewardError(f"grpo.rewards: {name} returned {len(values)} values at step {step} for "
                              f"{len(completions)} completions; return one float per completion")
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardError(f"grpo.rewards: {name} returned a value that is not a number at step {step}; return "
                              "one float per completion") from None
        if not all(math.isfinite(v) for v in values):
            raise RewardError(f"grpo.rewards: {name} returned a non-finite value at step {step}; return finite floats")
        totals = [t + v for t, v in zip(totals, values)]
    return totals
