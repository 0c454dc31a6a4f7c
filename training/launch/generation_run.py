"""Generation from a training checkpoint, in one process or in a layout of self-launched workers: the checkpoint's
dense weights, each rank's share built by the engine's own passes, then `engine.generate` (the generation schedule)
on every rank; the first rank's completions come back."""

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from checkpoint.export import read_merged_weights
from models import build_model, config_from_record, decoder_of
from parallel.engine import build_engine
from parallel.expert import check_expert_parallel
from parallel.generation import Rollout, Sampling
from parallel.grid import ParallelGrid
from parallel.pipeline.lowered import lower_pipeline
from parallel.spec import PipelineSpec
from training.specs import default_engine_spec

LAYOUT_KEYS = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.vpp", "parallel.emulate",
               "schedule")


@dataclass(frozen=True)
class Layout:
    """Where generation runs: the training layout's sizes, schedule (its placement of stages) and emulation."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1
    emulate: bool = False
    schedule: str = "1f1b"

    @property
    def world_size(self) -> int:
        """Processes to launch: dp * tp * pp (pp counts once under emulation)."""
        return self.dp * self.tp * (1 if self.emulate else self.pp)


def parse_layout(items: list[str]) -> Layout:
    """`parallel.tp=2 parallel.pp=2 ...` -> Layout; ValueError naming the bad item in one line."""
    layout = Layout()
    for item in items:
        key, sep, value = item.partition("=")
        key = "schedule" if key == "schedule.name" else key
        if not sep or key not in LAYOUT_KEYS:
            raise ValueError(f"--layout {item}: use key=value with a key of {', '.join(LAYOUT_KEYS)}")
        field = key.rpartition(".")[2]
        if field == "emulate":
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--layout {item}: parallel.emulate is true or false")
            layout = replace(layout, emulate=value.lower() == "true")
        elif field == "schedule":
            layout = replace(layout, schedule=value)
        else:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--layout {item}: {key} is a positive whole number")
            layout = replace(layout, **{field: int(value)})
    if layout.dp % layout.ep:
        raise ValueError(f"--layout: parallel.ep={layout.ep} does not divide parallel.dp={layout.dp}")
    return layout


def layout_problem(meta: dict, layout: Layout) -> str | None:
    """One line, before any worker starts, where the layout cannot split the checkpoint's model: its pipeline
    (partition, schedule), a size TP does not divide, experts EP cannot split (the passes' own checks)."""
    decoder = decoder_of(build_model(config_from_record(meta["model"])))  # the meta device: shapes only
    spec = PipelineSpec(pp=layout.pp, vpp=layout.vpp, schedule=layout.schedule, n_microbatches=layout.pp * layout.vpp)
    try:
        lower_pipeline(spec, decoder.config.num_hidden_layers)
        for key, size in decoder.adapter.tp_sizes().items():
            if size % layout.tp:
                return f"--layout parallel.tp={layout.tp} does not divide the model's {key}={size}"
        check_expert_parallel(decoder, layout.dp, layout.ep)
    except ValueError as error:
        return str(error).strip().splitlines()[0]
    return None


def layout_engine(state: dict[str, torch.Tensor], meta: dict, layout: Layout, grid: ParallelGrid, context: int):
    """This rank's step engine on the checkpoint's weights: the model built on the meta device, then each rank's
    parameters materialised from `state` by the engine's passes (pruned, TP-sharded, EP-split)."""
    decoder = decoder_of(build_model(config_from_record(meta["model"])))
    spec = default_engine_spec(PipelineSpec(pp=layout.pp, vpp=layout.vpp, schedule=layout.schedule,
                                            n_microbatches=layout.pp * layout.vpp),
                               micro_batch_size=1, seq_len=context, emulate=layout.emulate, timeout_s=120)
    return build_engine(spec, decoder, grid, lambda name, shape: state[name])


def worker(path: str, layout: Layout, prompts: torch.Tensor, mask: torch.Tensor, sampling: Sampling) -> Rollout:
    """One launched rank: join the group, build its share, generate; every replica completes every prompt (row
    numbers from 0, so every replica draws what one process draws)."""
    state, meta = read_merged_weights(path)
    grid = ParallelGrid.build(layout.dp, layout.tp, 1 if layout.emulate else layout.pp, backend="gloo",
                              timeout_s=120, ep=layout.ep)
    engine = layout_engine(state, meta, layout, grid, prompts.shape[1] + sampling.max_new_tokens)
    return engine.generate(prompts, mask, sampling, first_row=0)


def generate_in_workers(path: str | Path, layout: Layout, prompts: torch.Tensor, mask: torch.Tensor,
                        sampling: Sampling) -> Rollout:
    """Launch layout.world_size local workers (torch's elastic launcher, as train.py's) and return rank 0's Rollout."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if layout.world_size == 1:  # an emulated pipeline of one process: nothing to launch
        return worker(str(path), layout, prompts, mask, sampling)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers share this host's cores
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=layout.world_size, run_id="sluice-generate",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    results = elastic_launch(config, entrypoint=worker)(str(path), layout, prompts, mask, sampling)
    return results[0]
