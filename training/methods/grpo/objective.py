"""GRPO's policy loss over sampled completions: MiniMind's clipped ratio (`grpo`) or CISPO (`cispo`), with a k3 KL
penalty to the reference, a mean over each completion's tokens, then over the global batch's completions.

The formulas restate MiniMind's trainer/train_grpo.py (jingyaogong/minimind). Per completion token t of row i, with
`p` the policy's log-probability (through the layout's token loss: TP's vocab-sharded logits need nothing of their
own), `o` the rollout's ("old") and `q` the reference's, and the row's advantage `A`:

    r = exp(p - o),  kl = exp(q - p) - (q - p) - 1
    grpo:  l = -(min(r A, clip(r, 1 - epsilon, 1 + epsilon) A) - beta kl)
    cispo: l = -(min(r, epsilon_high).detach() A p - beta kl)

and the row's loss is the mean of `l` over its completion tokens (at least one counted). A training row is the
prompt's real tokens then the completion (training.methods.grpo.rollouts); its labels are the completion tokens (-100
elsewhere), and the payload says where among the shifted positions its completion starts (`START`), N the payload's
width.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from parallel.step import IGNORE_INDEX, MicroBatch, TokenLoss

ADVANTAGES = "grpo_advantages"  # [B] float32: each row's group-normalised advantage
OLD_LOGPS = "grpo_old_logps"  # [B, N] float32: the rollout's log-probability of each completion token
REF_LOGPS = "grpo_ref_logps"  # [B, N] float32: the reference's
REWARDS = "grpo_rewards"  # [B] float32: each row's summed reward (logged)
FLAT = "grpo_flat"  # [B] bool: the row's group had equal rewards (zero spread: advantage 0)
START = "grpo_start"  # [B] long: the shifted position of each row's first completion token (its prompt length - 1)
KEYS = (ADVANTAGES, OLD_LOGPS, REF_LOGPS, REWARDS, FLAT, START)


def completion_logps(logits: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor, width: int,
                     token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, width] log-probabilities, mask) of each row's completion positions from its start (0, False at -100)."""
    shifted = -token_loss(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).view(labels.shape[0], -1)
    where = starts.to(shifted.device).long()[:, None] + torch.arange(width, device=shifted.device)  # [B, width]
    mask = labels[:, 1:].to(shifted.device).gather(1, where) != IGNORE_INDEX
    return shifted.gather(1, where).float(), mask


def token_terms(logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor,
                loss_type: str, beta: float, epsilon: float, epsilon_high: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token k3 KL, clipped) of [B, N] log-probabilities and [B] advantages."""
    delta = ref - logps
    kl = torch.exp(delta) - delta - 1
    ratio = torch.exp(logps - old)
    advantage = advantages.unsqueeze(1)
    if loss_type == "cispo":
        capped = torch.clamp(ratio, max=epsilon_high).detach()
        return -(capped * advantage * logps - beta * kl), kl, ratio.detach() > epsilon_high
    plain, clipped = ratio * advantage, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantage
    return -(torch.min(plain, clipped) - beta * kl), kl, (clipped < plain).detach()


@dataclass(frozen=True)
class GroupPolicyLoss:
    """MiniMind's GRPO / CISPO loss, a mean over the completions of the global batch. Sums per micro-batch (float64):
    the loss, the rewards and their squares, the advantages and their squares, the reference KL `q - p` over completion
    tokens (MiniMind's logged `kl_ref`), the completion tokens, the clipped tokens, the rows of zero-spread groups, and
    the rows' absolute losses (the loss is a sum of terms that cancel within a group, whose advantages sum to 0: their
    size, not the loss's, says how near two layouts' losses are)."""

    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float
    num_generations: int
    width: ClassVar[int] = 10

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [k for k in KEYS if k not in extra]
        if missing:
            raise ValueError(f"a GRPO micro-batch carries no {', '.join(missing)}; build it with training.methods.grpo.step")
        device = logits.device
        old, ref = (extra[k].to(device, torch.float32) for k in (OLD_LOGPS, REF_LOGPS))
        advantages, rewards = (extra[k].to(device, torch.float32) for k in (ADVANTAGES, REWARDS))
        logps, mask = completion_logps(logits, labels, extra[START], old.shape[1], token_loss)
        old, ref = torch.where(mask, old, 0.0), torch.where(mask, ref, 0.0)  # nothing from padding reaches exp
        per_token, kl, clipped = token_terms(logps, old, ref, advantages, self.loss_type, self.beta, self.epsilon,
                                             self.epsilon_high)
        weights = mask.float()
        per_row = (per_token * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        loss_sum = per_row.sum()
        with torch.no_grad():
            d = torch.float64
            sums = torch.stack([loss_sum.to(d), rewards.sum().to(d), rewards.square().sum().to(d),
                                advantages.sum().to(d), advantages.square().sum().to(d),
                                ((ref - logps) * weights).sum().to(d), weights.sum().to(d),
                                (clipped & mask).sum().to(d), extra[FLAT].to(device).sum().to(d),
                                per_row.abs().sum().to(d)])
        return loss_sum, sums

    def count(self, micro_batch: MicroBatch) -> torch.Tensor:
        """Completions: the loss is a mean over them."""
        return torch.tensor(micro_batch.labels.shape[0])

    def metrics(self, sums: list[float], count: int) -> dict[str, float]:
        """Reward mean and spread, advantage mean and spread, KL to the reference per completion token, completion
        length, the share of completion tokens clipped, the groups of equal rewards, and the mean absolute loss of a
        completion (`loss_magnitude`: the scale of the terms the near-zero loss is a sum of)."""
        n, tokens = max(count, 1), max(sums[6], 1.0)
        reward, advantage = sums[1] / n, sums[3] / n
        return {"reward_mean": reward, "reward_std": math.sqrt(max(sums[2] / n - reward ** 2, 0.0)),
                "advantage_mean": advantage, "advantage_std": math.sqrt(max(sums[4] / n - advantage ** 2, 0.0)),
                "kl_ref": sums[5] / tokens, "completion_len": sums[6] / n, "clip_fraction": sums[7] / tokens,
                "flat_groups": round(sums[8] / self.num_generations), "loss_magnitude": sums[9] / n}
