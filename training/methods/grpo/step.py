"""One GRPO step's data, before the engine's ordinary training step: each prompt of this DP replica's micro-batches
is completed `grpo.num_generations` times by `engine.generate` in the training layout, the completions are scored,
their rewards normalised within each group into advantages, and the reference (the starting weights) gives its
log-probabilities; the micro-batches that come out carry the completions and that payload to GroupPolicyLoss.

The sampling seed is a function of `train.seed` and the step alone, so a resumed run draws what the uninterrupted
run drew with no state of its own; generation keys each draw by (seed, row, token), so every layout draws the same.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from parallel.grid import ParallelGrid
from parallel.step import IGNORE_INDEX, Engine, MicroBatch, StepResult
from training.methods.grpo.reference import StartingWeights
from training.methods.grpo.rollouts import group_advantages, padded, training_rows, write_samples
from training.methods.grpo.scoring import Scorer
from training.methods.grpo.objective import ADVANTAGES, FLAT, OLD_LOGPS, REF_LOGPS, REWARDS, START
from parallel.generation import Sampling

log = logging.getLogger("sluice")
SAMPLE_GROUPS = 2  # groups of DP replica 0 written to rollouts.jsonl per sampled step


def sampling_seed(seed: int, step: int) -> int:
    """The rollout's sampling seed of `step` (1-based): a 63-bit mix of train.seed and the step, the same in every
    process and after a resume."""
    return random.Random(f"grpo:{seed}:{step}").getrandbits(63)


@dataclass(frozen=True)
class GrpoSpec:
    """What the GRPO step reads of the run config."""

    num_generations: int
    max_new_tokens: int
    temperature: float
    top_p: float
    sample_every: int
    seed: int

    @staticmethod
    def of(cfg: DictConfig) -> GrpoSpec:
        g = cfg.grpo
        return GrpoSpec(int(g.num_generations), int(g.max_new_tokens), float(g.temperature), float(g.top_p),
                        int(g.sample_every), int(cfg.train.seed))


class GrpoStep:
    """Turns a step's prompt micro-batches into its training micro-batches (`prepare`), then logs it (`after_step`)."""

    def __init__(self, cfg: DictConfig, engine: Engine, grid: ParallelGrid, tokenizer: PreTrainedTokenizerBase,
                 run_dir: Path):
        self.spec, self.engine, self.grid = GrpoSpec.of(cfg), engine, grid
        self.tokenizer, self.run_dir = tokenizer, run_dir
        self.reference = StartingWeights(engine)  # before any step or resume moves the weights
        self.scorer = Scorer(list(cfg.grpo.rewards), cfg.grpo.reward_model, tokenizer, grid)
        self.rollout_s = self.reference_s = 0.0
        self.samples: list[dict[str, Any]] = []

    def sampling(self, step: int):
        s, tok = self.spec, self.tokenizer
        return Sampling(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=sampling_seed(s.seed, step))

    def prepare(self, step: int, prompt_batches: list[MicroBatch]) -> list[MicroBatch]:
        """The training micro-batches of `step` (1-based) from the replica's prompt micro-batches, groups kept whole."""
        group, width = self.spec.num_generations, self.spec.max_new_tokens
        prompts = torch.cat([mb.input_ids for mb in prompt_batches]).repeat_interleave(group, dim=0)
        mask = torch.cat([mb.labels != IGNORE_INDEX for mb in prompt_batches]).repeat_interleave(group, dim=0)
        start = time.perf_counter()
        rollout = self.engine.generate(prompts, mask, self.sampling(step))
        self.rollout_s = time.perf_counter() - start
        completions = rollout.tokens[:, prompts.shape[1]:]
        rewards = self.scorer(step, prompts, mask, completions, rollout.completion_mask)
        advantages, flat = group_advantages(rewards, group)
        ids, labels, starts = training_rows(rollout.tokens, mask, rollout.completion_mask, width,
                                            self.tokenizer.pad_token_id)
        rows = group * len(prompt_batches[0].input_ids)
        micro_batches = [MicroBatch(ids[i:i + rows], labels[i:i + rows], prompt_batches[0].global_tokens,
                                    {START: starts[i:i + rows]}) for i in range(0, len(ids), rows)]
        start = time.perf_counter()
        reference = self.reference.token_logps(micro_batches, width)
        self.reference_s = time.perf_counter() - start
        old = padded(rollout.log_probs.float(), width)
        for i, mb in zip(range(0, len(ids), rows), micro_batches):
            part = slice(i, i + rows)
            mb.extra.update({ADVANTAGES: advantages[part], OLD_LOGPS: old[part], REF_LOGPS: reference[part],
                             REWARDS: rewards[part], FLAT: flat[part]})
        if self.grid.rank == 0 and self.spec.sample_every and step % self.spec.sample_every == 0:
            prompt_texts, completion_texts = self.scorer.texts
            self.samples = [{"step": step, "prompt": prompt_texts[i], "completion": completion_texts[i],
                             "reward": float(rewards[i]), "advantage": float(advantages[i])}
                            for i in range(min(len(ids), SAMPLE_GROUPS * group))]
        return micro_batches

    def after_step(self, step: int, result: StepResult) -> dict[str, float]:
        """Global rank 0: write the step's samples, say when groups had equal rewards; every rank: the step's
        rollout record (generated tokens of the global batch per second of this rank's rollout)."""
        flat = int(result.metrics.get("flat_groups", 0))
        if self.grid.rank == 0:
            if self.samples:
                write_samples(self.run_dir, step, self.samples)
                self.samples = []
            if flat:
                groups = result.tokens // self.spec.num_generations
                log.info("grpo: step %d: %d of %d groups had equal rewards (zero spread): their advantages are 0 and "
                         "they teach nothing but the KL term", step, flat, groups)
        generated = result.metrics.get("completion_len", 0.0) * result.tokens
        return {"rollout_s": self.rollout_s, "reference_s": self.reference_s,
                "rollout_tokens_per_s": generated / max(self.rollout_s, 1e-9)}
