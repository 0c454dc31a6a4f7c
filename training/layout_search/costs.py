"""What one layout's step is made of, measured once per (model, shape, dtype, device, backend, threads) and
cached as JSON: compute times and saved bytes per piece of the model, parameter counts, transport timings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig
from training.config.schema import model_config

RECOMPUTE_MODES = ("none", "full", "selective")
ADAMW_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32, per parameter
VERSION = 5  # part of every key: a change in what is measured invalidates older cache files


@dataclass(frozen=True)
class Fit:
    """A linear time model of a transfer: latency + bytes * per_byte (seconds)."""

    latency_s: float
    per_byte_s: float

    def time(self, nbytes: float) -> float:
        """Seconds to move `nbytes`."""
        return self.latency_s + nbytes * self.per_byte_s

    @staticmethod
    def of(points: list[tuple[float, float]]) -> Fit:
        """Least-squares line through (bytes, seconds) points, clamped to non-negative terms."""
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        slope = max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0) if var > 0 else 0.0
        return Fit(max(my - slope * mx, 0.0), slope)


@dataclass(frozen=True)
class MeasuredCosts:
    """Seconds per micro-batch of each piece (tp=1, this device and dtype), bytes, and transport fits."""

    key: dict
    layer_f: float  # one decoder layer's forward
    layer_b: dict[str, float]  # its full backward, per recompute mode (recomputation included)
    layer_i: dict[str, float]  # its input-gradient backward (I), per recompute mode
    layer_w: float  # its deferred weight gradients (W)
    embed_f: float
    embed_b: float
    embed_i: float
    embed_w: float
    head_f: float  # final norm + lm_head + loss
    head_b: float
    head_i: float
    head_w: float
    layer_saved: dict[str, int]  # bytes one layer saves for backward per micro-batch, per recompute mode
    layer_deferred: int  # bytes one layer holds between I and W per micro-batch
    embed_saved: int
    embed_deferred: int
    head_saved: int
    head_deferred: int  # the lm_head's input and output gradient, between I and W
    layer_params: int  # parameter counts (tp=1)
    embed_params: int
    head_params: int  # final norm, plus lm_head where it is not tied to the embedding
    param_bytes: int  # bytes per parameter (its storage dtype)
    optimizer_s_per_param: float  # gradient-norm clipping and the AdamW step
    boundary_bytes: int  # one micro-batch's hidden states between stages
    p2p: Fit = field(default_factory=lambda: Fit(0.0, 0.0))
    allreduce: Fit = field(default_factory=lambda: Fit(0.0, 0.0))  # per call, two ranks
    # Seconds of each timed piece that do not grow with the micro-batch (kernel launches, Python, small-matmul
    # inefficiency), from timing it at two micro-batch sizes; keyed like `timed_fields`. Empty: linear scaling.
    fixed: dict[str, float] = field(default_factory=dict)
    layer_expert_params: int = 0  # of layer_params, those of the layer's experts (split over parallel.ep)

    def scaled(self, name: str, value: float, ratio: float) -> float:
        """`value` (the time of piece `name` at the profiled micro-batch) at `ratio` times that micro-batch."""
        fixed = min(self.fixed.get(name, 0.0), value)
        return fixed + (value - fixed) * ratio

    def to_json(self) -> str:
        """The cache file's text."""
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> MeasuredCosts:
        """Read what `to_json` wrote."""
        data = json.loads(text)
        data["p2p"], data["allreduce"] = Fit(**data["p2p"]), Fit(**data["allreduce"])
        return MeasuredCosts(**data)


def timed_fields(compute: dict) -> dict[str, float]:
    """Every per-micro-batch time of a `measure_compute` result, by name (`layer_b.full` for a per-mode one)."""
    out = {}
    for name, value in compute.items():
        if name.endswith("_saved") or not name.startswith(("layer_", "embed_", "head_")):
            continue
        if isinstance(value, dict):
            out.update({f"{name}.{mode}": v for mode, v in value.items()})
        elif isinstance(value, float):
            out[name] = value
    return out


def fixed_parts(at_one: dict[str, float], at_two: dict[str, float]) -> dict[str, float]:
    """Per piece, the intercept a of t(b) = a + c b from its times at b and 2b (clamped to [0, t(b)])."""
    return {name: min(max(2 * t - at_two[name], 0.0), t) for name, t in at_one.items()}


def cost_key(cfg: DictConfig, device: str, dtype: str, backend: str, threads: int) -> dict:
    """What the measurements depend on: model dims, micro-batch shape, dtype, device, backend, threads."""
    from models import config_record  # every model family (seconds to import): only once a model is built

    dims = {k: v for k, v in config_record(model_config(cfg)).items() if k != "num_hidden_layers"}  # one layer's
    return {"version": VERSION, "model": dims, "micro_batch_size": cfg.train.micro_batch_size,
            "seq_len": cfg.train.seq_len, "dtype": dtype, "device": device, "backend": backend, "threads": threads}


def cache_path(cfg: DictConfig, key: dict) -> Path:
    """The JSON file of `key` under the data cache dir's costs/ folder."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.data.cache_dir) / "costs" / f"costs-{digest}.json"


def load_cached(cfg: DictConfig, key: dict) -> MeasuredCosts | None:
    """The cached measurement of `key`, or None (absent, or written by another version of this file)."""
    path = cache_path(cfg, key)
    try:
        costs = MeasuredCosts.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return costs if costs.key == key else None


def save(cfg: DictConfig, costs: MeasuredCosts) -> Path:
    """Write `costs` to its cache file (atomically: a rename); return the path."""
    path = cache_path(cfg, costs.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs sharing the cache may measure at once
    tmp.write_text(costs.to_json())
    tmp.replace(path)
    return path
