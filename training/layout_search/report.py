"""After a traced step: the cost model's prediction for this layout next to what the step measured."""

import logging

from omegaconf import DictConfig

from training.layout_search.predict import candidate_of, predict
from training.layout_search.profile import measured_costs

log = logging.getLogger("sluice")
MIB = 1 << 20


def prediction_record(cfg: DictConfig, grid, record: dict) -> dict:
    """`predicted_step_s` and `predicted_peak_mem_bytes` (None without cached costs for this shape), logged by
    rank 0 against the record's `step_time_s` and `peak_mem_bytes`. Not collective: reads the cache only."""
    costs = measured_costs(cfg, world_size=grid.world_size, cached_only=True)
    if costs is None:
        if grid.rank == 0:
            log.info("predicted step: no measured costs for this shape and machine; run python "
                     "scripts/profile_costs.py with this run's overrides to compare predictions with measurements")
        return {"predicted_step_s": None, "predicted_peak_mem_bytes": None}
    prediction = predict(candidate_of(cfg, grid.dp), cfg, costs)
    peak = max(prediction.peak_bytes)
    if grid.rank == 0:
        log.info(f"predicted step {prediction.step_s:.3f} s vs measured {record['step_time_s']:.3f} s; peak memory "
                 f"predicted {peak / MIB:.1f} MiB (parameters, gradients, AdamW, activations) vs measured "
                 f"{record['peak_mem_bytes'] / MIB:.1f} MiB (process peak, runtime included)")
    return {"predicted_step_s": prediction.step_s, "predicted_peak_mem_bytes": peak}
