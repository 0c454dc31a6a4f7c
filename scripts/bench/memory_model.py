"""Acceptance: predicted peak memory per pipeline rank against a step's measured peak, pp=2, for 1F1B, GPipe
and ZB-H1 with recompute none and full.

    python scripts/bench/memory_model.py [model/shape overrides]

Measured side, per pipeline rank of an emulated step (the same per-rank action order as a real run): the most
activation bytes alive at once (what autograd saves, counted by saved-tensor hooks until the graph frees it,
plus what I leaves for W until W runs), plus the bytes of the parameters, gradients and AdamW state the rank
really holds after the step. Not the process peak: that also holds the runtime, the data and the allocator's
slack, which no layout changes (`peak_mem_bytes` in metrics.jsonl records it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, ActivationMeter, _Held  # noqa: E402

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.step import MicroBatch  # noqa: E402
from training.config import CONF_DIR, register_schema  # noqa: E402
from training.config.validate import validate  # noqa: E402
from training.layout_search.costs import MeasuredCosts  # noqa: E402
from training.layout_search.predict import candidate_of, predict  # noqa: E402
from training.specs import engine_spec  # noqa: E402
from training.trainer import build_model  # noqa: E402

CPU = torch.device("cpu")
SHAPE = ["model.num_hidden_layers=8", "model.hidden_size=256", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "train.seq_len=128", "train.micro_batch_size=4", "train.dtype=fp32",
         "parallel.pp=2", "schedule.n_microbatches=8", "logger=none"]
LAYOUTS = [(schedule, mode) for schedule in ("1f1b", "gpipe", "zb-h1") for mode in ("none", "full")]


def config(overrides: list[str]):
    """The run config train.py would compose, validated."""
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    validate(cfg)
    return cfg


class LiveBytes(ActivationMeter):
    """Activation bytes alive at once on one pipeline rank (each storage once; parameters never)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.deferred: dict[int, list[int]] = {}  # micro-batch -> storages held for W

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.params:
            return t
        return _Held(t, self)


def _unpack(held):
    return held.tensor if isinstance(held, _Held) else held


def meter_stage(stage, meter: LiveBytes) -> None:
    """Count the stage's saved tensors from F to B/I, and what I defers, until W."""
    forward, backward_input, backward_weight = stage.forward, stage.backward_input, stage.backward_weight

    def metered_forward(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, _unpack):
            return forward(*args, **kwargs)

    def metered_input(mb, *args, **kwargs):
        out = backward_input(mb, *args, **kwargs)
        meter.deferred[mb] = [meter.hold(t) for work in stage.weight_grads.pending[mb]
                              for t in (work.inputs, work.grad_output)]
        return out

    def metered_weight(mb):
        backward_weight(mb)
        for key in meter.deferred.pop(mb):
            meter.release(key)

    stage.forward, stage.backward_input, stage.backward_weight = metered_forward, metered_input, metered_weight


def state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and their AdamW state."""
    tensors = [t for p in params for t in (p, p.grad, *optimizer.state[p].values())
               if isinstance(t, torch.Tensor) and t.dim() > 0]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def measured_peaks(cfg) -> list[int]:
    """Per pipeline rank: peak live activation bytes of one emulated step + its parameter/gradient/AdamW bytes."""
    with open_dict(cfg):
        cfg.parallel.emulate = True
    model, weights = build_model(cfg)
    engine = build_engine(engine_spec(cfg, CPU), model, ParallelGrid.single(CPU), weights)
    meters = {s: LiveBytes(list(stage.module.parameters())) for s, stage in engine.stages.items()}
    for s, stage in engine.stages.items():
        meter_stage(stage, meters[s])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (cfg.schedule.n_microbatches, cfg.train.micro_batch_size,
                                                  cfg.train.seq_len), generator=gen)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    engine.step([MicroBatch(x, x.clone()) for x in ids])
    optimizer.step()
    return [meters[s].peak + state_bytes(list(stage.module.parameters()), optimizer)
            for s, stage in sorted(engine.stages.items())]


def compare(base: list[str], costs_of) -> list[tuple[str, str, list[int], list[int]]]:
    """(schedule, recompute, predicted per rank, measured per rank) for every layout of LAYOUTS."""
    rows = []
    for schedule, mode in LAYOUTS:
        cfg = config([*base, f"schedule={schedule}", f"train.recompute={mode}"])
        predicted = list(predict(candidate_of(cfg), cfg, costs_of(cfg)).peak_bytes)
        rows.append((schedule, mode, predicted, measured_peaks(cfg)))
    return rows


def main(argv: list[str]) -> int:
    """Profile the shape (cached), then print predicted against measured peaks per rank."""
    from training.layout_search.profile import measured_costs

    base = [*SHAPE, f"data.cache_dir={ROOT / '.cache' / 'sluice'}", *argv]
    costs: MeasuredCosts = measured_costs(config(base), world_size=2)
    worst = 0.0
    for schedule, mode, predicted, measured in compare(base, lambda cfg: costs):
        errors = [p / m - 1 for p, m in zip(predicted, measured)]
        worst = max(worst, *map(abs, errors))
        print(f"{schedule:<6} recompute={mode:<5} " + "; ".join(
            f"rank {r}: predicted {p / 2**20:7.1f} MiB, measured {m / 2**20:7.1f} MiB ({e:+.1%})"
            for r, (p, m, e) in enumerate(zip(predicted, measured, errors))))
    print(f"worst error {worst:.1%} (acceptance: within 20%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
