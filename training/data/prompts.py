"""GRPO's prompts: conversations up to their last user turn, rendered with the chat template and its generation
prompt (MiniMind's RLAIFDataset: `rlaif.jsonl`, whose rows end with an empty assistant turn that is dropped), kept
in memory as token ids and served left-padded to `train.seq_len - grpo.max_new_tokens` tokens.

A sample is one prompt; a micro-batch of `train.micro_batch_size` sequences holds `micro_batch_size /
grpo.num_generations` prompts, each standing for its group of completions (the loss is a mean over completions, so
a prompt counts `num_generations`). The step stream (shuffle, DP shards, resume position) is the one every task
uses. A prompt longer than its width keeps its end, as MiniMind cuts (`[:, -max_seq_len:]`), and the cut is counted.
"""

import logging
import random
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from parallel.step import IGNORE_INDEX
from training.data.chat_rules import ChatRules
from training.data.pair_corpus import synthetic_pairs
from training.data.spec import DataError, DataSpec
from training.data.stream import StepBatches
from training.data.sources import data_source

log = logging.getLogger("sluice")


def prompt_turns(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns a completion answers: everything up to and including the last user turn."""
    last = max(i for i, turn in enumerate(conversation) if turn.get("role") == "user")
    return conversation[:last + 1]


def render_prompt(tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, Any]], thinking: bool) -> list[int]:
    """A prompt's token ids: the chat template with the generation prompt (`open_thinking` where the template reads
    it: MiniMind's opens a `<think>` block; the embedded ChatML ignores it)."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, open_thinking=thinking)
    return tokenizer(text, add_special_tokens=False).input_ids


class PromptSamples:
    """Prompts as left-padded samples: `take` -> (ids [n, width] padded on the left with `pad_id`, labels = the ids
    where real and -100 on padding, i.e. the prompt mask); `label_counts` counts `group` per prompt."""

    def __init__(self, prompts: list[list[int]], width: int, pad_id: int, group: int):
        self.prompts, self.seq_len, self.pad_id, self.group = prompts, width, pad_id, group
        self.cut = sum(len(p) > width for p in prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(index), self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for row, i in enumerate(index.tolist()):
            tokens = torch.tensor(self.prompts[i][-self.seq_len:], dtype=torch.long)
            ids[row, self.seq_len - len(tokens):] = tokens
            labels[row, self.seq_len - len(tokens):] = tokens
        return ids, labels

    def label_counts(self, index: torch.Tensor) -> torch.Tensor:
        return torch.full((len(index),), self.group, dtype=torch.int64)


def prompt_rows(spec: DataSpec) -> tuple[list[list[dict[str, Any]]], int]:
    """(the prompts' turns, bad rows skipped): the embedded prompts, or the rows of `data.path`."""
    if spec.name == "synthetic":  # the embedded DPO pairs' questions: the SFT and DPO models have seen their kind
        return [prompt_turns(row["chosen"]) for row in synthetic_pairs(spec.num_docs, spec.seed)], 0

    rows = data_source(spec, "data.path").reader()
    prompts = [prompt_turns(payload) for _, payload in rows]
    rows.report()
    return prompts, rows.skipped


def build_prompts(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, width: int, group: int,
                  thinking_ratio: float) -> tuple[PromptSamples, int]:
    """(the prompt samples, bad rows skipped): each prompt with its system prompt (`data.system_prompts`) and its
    open think block drawn per row from `data.seed` (the same on every rank and after a resume)."""
    turns, skipped = prompt_rows(spec)
    if not turns:
        raise DataError(f"data.path: no usable prompt in '{spec.path}' ({skipped} bad rows skipped); give rows whose "
                        "conversations hold a user turn")
    rules = ChatRules("keep", spec.system_prompts, spec.system_ratio, spec.seed)
    ids = [render_prompt(tokenizer, list(rules.conversation(row, t)),
                         random.Random(f"{spec.seed}:{row}:thinking").random() < thinking_ratio)
           for row, t in enumerate(turns)]
    samples = PromptSamples(ids, width, tokenizer.pad_token_id, group)
    return samples, skipped


def build_prompt_stream(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, cfg: Any, dp_rank: int, dp_size: int,
                        verbose: bool) -> StepBatches:
    """The step stream of prompts for DP replica `dp_rank` (a prompt width of train.seq_len - grpo.max_new_tokens)."""
    train, grpo = cfg.train, cfg.grpo
    group = int(grpo.num_generations)
    samples, skipped = build_prompts(spec, tokenizer, int(train.seq_len) - int(grpo.max_new_tokens), group,
                                     float(grpo.thinking_ratio))
    if verbose and samples.cut:
        log.warning("data: %d of %d prompts are longer than train.seq_len - grpo.max_new_tokens = %d tokens and keep "
                    "their end (as MiniMind cuts them)", samples.cut, len(samples), samples.seq_len)
    return StepBatches(samples, int(train.micro_batch_size) // group, int(cfg.schedule.n_microbatches), dp_rank,
                       dp_size, int(train.seed), skipped_lines=skipped, shuffle=spec.shuffle)
