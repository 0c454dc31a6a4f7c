"""Scoring a DP replica's completions once: the replica's first rank (pipeline rank 0, TP rank 0) decodes them, runs
the rewards (and holds the reward model, the only rank of the replica that does) and broadcasts the summed rewards
to the replica's other ranks, so a reward that is not deterministic (a sampled judge, a clock) still gives every
stage the same advantages. A failure is broadcast too: every rank of the replica stops with the step named."""

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from parallel.grid import ParallelGrid
from training.methods.grpo.rewards import RewardError, RewardFn, reward_function, reward_name, score
from training.methods.grpo.reward_model import RewardModel, reward_model_problem


def replica_group(grid: ParallelGrid) -> dist.ProcessGroup | None:
    """The ranks of this rank's DP replica (every pipeline and TP rank of it), or None alone. Collective: every
    rank creates every replica's group in the same order."""
    if grid.world_size == 1 or grid.pp * grid.tp == 1:
        return None
    mine = None
    for d in range(grid.dp):
        ranks = [grid.global_rank_of(p, d, t) for p in range(grid.pp) for t in range(grid.tp)]
        group = dist.new_group(ranks)
        if grid.rank in ranks:
            mine = group
    return mine


class Scorer:
    """Decodes the replica's rows and scores them on its first rank; every rank gets the rewards [B] float32."""

    def __init__(self, entries: list, reward_model: str | None, tokenizer: PreTrainedTokenizerBase,
                 grid: ParallelGrid):
        self.grid, self.tokenizer = grid, tokenizer
        self.lead = grid.global_rank_of(0, grid.dp_rank, 0) if grid.world_size > 1 else 0
        self.group = replica_group(grid)
        self.functions: dict[str, RewardFn] = {}
        self.texts: tuple[list[str], list[str]] = ([], [])  # the last step's (prompts, completions), on the lead
        if grid.rank == self.lead:
            self.functions = {reward_name(e): reward_function(e) for e in entries}
            if reward_model is not None:  # checked again here: before launch the embedded tokenizer may not exist
                if problem := reward_model_problem(reward_model, tokenizer):
                    raise RewardError(problem)
                self.functions["grpo.reward_model"] = RewardModel(reward_model, tokenizer, grid.device)

    def decode(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, completions: torch.Tensor,
               completion_mask: torch.Tensor) -> tuple[list[str], list[str]]:
        """(the rendered prompt of each row, special tokens kept as MiniMind's prompt strings have them; its
        completion, special tokens skipped as MiniMind decodes)."""
        decode = self.tokenizer.decode
        return ([decode(p[m].tolist(), skip_special_tokens=False) for p, m in zip(prompts, prompt_mask)],
                [decode(c[m].tolist(), skip_special_tokens=True) for c, m in zip(completions, completion_mask)])

    def __call__(self, step: int, prompts: torch.Tensor, prompt_mask: torch.Tensor, completions: torch.Tensor,
                 completion_mask: torch.Tensor) -> torch.Tensor:
        rows = len(prompts)
        box = torch.zeros(rows + 1, dtype=torch.float64)
        problem = None
        if self.grid.rank == self.lead:
            self.texts = self.decode(prompts, prompt_mask, completions, completion_mask)
            try:
                box[:rows] = torch.tensor(score(self.functions, *self.texts, step), dtype=torch.float64)
            except RewardError as error:
                problem, box[rows] = str(error), 1.0
        if self.group is not None:
            box = box.to(self.grid.device)
            dist.broadcast(box, src=self.lead, group=self.group)
            box = box.cpu()
        if problem is not None:
            raise RewardError(problem)
        if box[rows] != 0:
            raise RewardError(f"grpo.rewards failed at step {step} on rank {self.lead}, which scores this DP replica; "
                              "its log names the reward and why")
        return box[:rows].float()
