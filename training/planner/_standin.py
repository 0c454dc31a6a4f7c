"""THROWAWAY stand-in for the profile helper's costs/predict (deleted before the final rebase)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from parallel.pipeline.actions import Costs
from parallel.pipeline.plan import plan_pipeline
from parallel.pipeline.simulate import SimResult, peak_live
from parallel.recompute import saved_activation_bytes_per_layer
from parallel.spec import PipelineSpec
from training.planner.costs import MeasuredCosts

from training.schema import model_config


@dataclass(frozen=True)
class Candidate:
    """One layout."""

    dp: int
    tp: int
    pp: int
    vpp: int
    schedule: str
    n_microbatches: int
    micro_batch_size: int
    recompute: str
    layers_per_stage: tuple[int, ...] | None = None

    def overrides(self) -> list[str]:
        """Hydra overrides that select it."""
        out = [f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
               f"parallel.vpp={self.vpp}", f"schedule={self.schedule}", f"schedule.n_microbatches={self.n_microbatches}",
               f"train.micro_batch_size={self.micro_batch_size}", f"train.recompute={self.recompute}"]
        if self.layers_per_stage is not None:
            out.append(f"parallel.layers_per_stage=[{','.join(map(str, self.layers_per_stage))}]")
        return out


@dataclass(frozen=True)
class Prediction:
    """Predicted step."""

    step_s: float
    peak_bytes: tuple[int, ...]
    sim: SimResult


def predict(candidate: Candidate, cfg: DictConfig, costs: MeasuredCosts) -> Prediction:
    """Unit-cost simulation scaled by the per-layer forward time; params x 16 bytes + live activations."""
    c = candidate
    spec = PipelineSpec(pp=c.pp, vpp=c.vpp, schedule=c.schedule if c.pp > 1 else "1f1b",
                        n_microbatches=c.n_microbatches, layers_per_stage=c.layers_per_stage)
    layers = cfg.model.num_hidden_layers
    plan = plan_pipeline(spec, layers)
    extra = 1.0 if c.recompute == "full" else 0.2 if c.recompute == "selective" else 0.0
    sim = plan.simulate(Costs(f=1.0, b=2.0 + extra, i=1.0 + extra, w=1.0))
    scale = costs.layer_f * layers / plan.n_stages * c.micro_batch_size / costs.key["micro_batch_size"] / c.tp
    per_layer = saved_activation_bytes_per_layer(model_config(cfg), c.micro_batch_size, cfg.train.seq_len, 4,
                                                 c.recompute, tp=c.tp)
    peaks = []
    for actions in plan.lowered:
        stages = {a.stage for a in actions}
        owned = sum(len(plan.partition[s]) for s in stages)
        acts = peak_live(actions, lambda s: len(plan.partition[s])) * per_layer
        peaks.append(owned * costs.layer_params * 16 // c.tp + acts)
    return Prediction(step_s=sim.makespan * scale, peak_bytes=tuple(peaks), sim=sim)


def cost_balanced_partition(num_layers: int, n_stages: int, embed: float, head: float) -> tuple[int, ...]:
    """Stand-in balancer: fewer layers on the last stage when the head is heavy."""
    counts = [num_layers // n_stages + (1 if s >= n_stages - num_layers % n_stages else 0) for s in range(n_stages)]
    if head > 1.0 and counts[-1] > 1 and n_stages > 1:
        counts[-1] -= 1
        counts[0 if counts[0] <= counts[-2] else -2] += 1
    return tuple(counts)

