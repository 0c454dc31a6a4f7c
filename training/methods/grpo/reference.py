"""GRPO's reference: the starting weights, kept as a frozen copy of this rank's trainable parameters and swapped in for
one forward-only pass of each step's fresh rollouts (their per-token log-probabilities).

Why a copy and a swap rather than DPO's once-only table or a second engine: the rollouts are new every step, so the
reference must run every step; a second engine would hold a second model (every frozen weight too) and a second
set of stages and buffers. The copy holds only what training changes (every weight, or LoRA's adapters alone), at
the rank's own shard: memory = this rank's trainable parameters once more, plus as much again during the pass (the
current weights set aside). The pass is the engine's own forward (`Engine.forward_sums`), so it runs in any layout.
"""

from dataclasses import dataclass

import torch

from parallel.step import Engine, MicroBatch, TokenLoss
from training.methods.grpo.objective import START, completion_logps
from training.objectives.reference import ROW, RowTable, placed_rows


@dataclass(frozen=True)
class TokenLogps(RowTable):
    """A forward-only objective: each row's log-probabilities of its `tokens` completion positions (from its `START`),
    at the row's place among `rows` (zeros elsewhere), so summing the micro-batches' values keeps every value exact."""

    rows: int
    tokens: int

    @property
    def width(self) -> int:
        return self.rows * self.tokens

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        logps, mask = completion_logps(logits, labels, extra[START], self.tokens, token_loss)
        logps = torch.where(mask, logps, 0.0).double()
        table = torch.zeros(self.rows, self.tokens, dtype=torch.float64, device=logps.device)
        table.index_copy_(0, extra[ROW].to(logps.device), logps)
        return logps.sum(), table.flatten()


def token_logps(engine: Engine, micro_batches: list[MicroBatch], tokens: int) -> torch.Tensor:
    """[rows, tokens] float32 on the CPU: each row's log-probabilities of its `tokens` completion labels (the
    micro-batches carry `START`) under the engine's current weights, forward only, the micro-batches' rows in order
    (every rank of the replica gets them)."""
    placed, rows = placed_rows(micro_batches)
    return engine.forward_sums(placed, TokenLogps(rows, tokens)).view(rows, tokens).float().cpu()


class StartingWeights:
    """A frozen copy of the engine's trainable parameters as they are now (before any step or resume): the
    reference policy."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.params = [p for p in engine.parameters() if p.requires_grad]
        self.copy = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def token_logps(self, micro_batches: list[MicroBatch], tokens: int) -> torch.Tensor:
        """`token_logps` under the starting weights; the current ones are put back, bit for bit, after the pass."""
        current = [p.detach().clone() for p in self.params]
        try:
            for p, start in zip(self.params, self.copy):
                p.copy_(start)
            return token_logps(self.engine, micro_batches, tokens)
        finally:
            for p, now in zip(self.params, current):
                p.copy_(now)
