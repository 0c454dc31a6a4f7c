"""The equivalence harness: a layout's training run against one process doing gradient accumulation.

A run records, per step, the loss every rank returns and rank 0's metrics (loss, aux_loss, grad_norm); the
gradients of step 1 (final, synchronised, before clipping) and the final parameters of every rank, each under
its dense name with its TP partition dim. `assert_equivalent` joins TP shards and compares every copy (every
DP replica, every TP rank of a replicated tensor, both copies of a tied embedding) with the single process.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from parallel.tensor_pass import join_blocks
from training.cli import CONF_DIR
from training.config import register_schema

BASE = ["train.seq_len=32", "train.micro_batch_size=2", "data.num_docs=300", "logger=none",
        "train.dtype=fp32", "optim.warmup_steps=1", "optim.lr=1e-3", "train.log_every=1"]
TIED = "model.embed_tokens.weight"  # the dense name of a tied embedding/lm_head pair
Tensors = dict[str, tuple[torch.Tensor, int | None, int]]  # dense name -> (tensor, TP partition dim or None, packing)


@dataclass(frozen=True)
class Tolerances:
    """Relative tolerances: per-step losses, grad norm, and per-tensor norms of gradients and parameters."""

    loss: float = 1e-5
    grad_norm: float = 1e-4
    grad: float = 1e-5
    param: float = 1e-4


FP32 = Tolerances()


def compose_run_config(overrides: list[str], cache_dir: Path) -> DictConfig:
    """The run config train.py would compose for these overrides."""
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*BASE, f"data.cache_dir={cache_dir}", *overrides])
    GlobalHydra.instance().clear()
    return cfg


def _snapshot(named: dict, grads: bool) -> Tensors:
    """Copies of this rank's parameters (or their gradients, zeros where none) with their TP partition dim."""
    out = {}
    for name, p in named.items():
        tensor = p.grad if grads else p
        tensor = torch.zeros_like(p) if tensor is None else tensor
        out[name] = (tensor.detach().float().cpu().clone(), getattr(p, "partition_dim", None), getattr(p, "tp_packed", 1))
    return out


def run_training(cfg: DictConfig, grid, run_dir: Path) -> dict:
    """Train; return losses, rank 0's metrics, step-1 gradients, the final parameters and the tied copies."""
    from training.trainer import Trainer

    trainer = Trainer(cfg, grid, run_dir)
    tied_copies = []  # the first stage's embedding or the last stage's lm_head after every step
    grads: Tensors = {}

    def record_grads(step: int) -> None:
        if step == 1:
            grads.update(_snapshot(trainer.engine.named_parameters(), grads=True))

    def record_tied(step: int) -> None:
        named = trainer.engine.named_parameters()
        for name in (TIED, "lm_head.weight"):
            if name in named:
                tied_copies.append((step, name, named[name].detach().cpu().clone()))

    losses = trainer.fit(on_step=record_tied, on_grads=record_grads)
    metrics = None
    if grid.rank == 0:  # only global rank 0 writes metrics.jsonl
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        metrics = [{k: json.loads(line)[k] for k in ("step", "loss", "aux_loss", "grad_norm")} for line in lines]
    return {"losses": losses, "metrics": metrics, "grads": grads, "coords": (grid.pp_rank, grid.dp_rank, grid.tp_rank),
            "params": _snapshot(trainer.engine.named_parameters(), grads=False), "tied": tied_copies}


def layout_worker(rank: int, world_size: int, overrides: list[str], cache_dir: str, run_dir: str) -> dict:
    """Spawned body: build the grid over gloo (no pipeline axis when emulated) and train."""
    return layouts_worker(rank, world_size, [(overrides, run_dir)], cache_dir)[0]


def layouts_worker(rank: int, world_size: int, runs: list[tuple[list[str], str]], cache_dir: str) -> list[dict]:
    """Spawned body: train several layouts in turn on one process group (one spawn, many layouts)."""
    from parallel.grid import ParallelGrid

    results = []
    for overrides, run_dir in runs:
        cfg = compose_run_config(overrides, Path(cache_dir))
        p = cfg.parallel
        grid = ParallelGrid.build(p.dp, p.tp, 1 if p.emulate else p.pp, backend="gloo", timeout_s=120)
        results.append(run_training(cfg, grid, Path(run_dir)))
    return results


def baseline(overrides: list[str], cache_dir: Path, run_dir: Path, dp: int) -> dict:
    """One process, same global batch: dp * n_microbatches micro-batches accumulated."""
    from parallel.grid import ParallelGrid

    cfg = compose_run_config(overrides, cache_dir)
    with open_dict(cfg):
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.vpp = 1, 1, 1, 1
        cfg.parallel.layers_per_stage, cfg.parallel.emulate = None, False
        cfg.schedule.n_microbatches = cfg.schedule.n_microbatches * dp
    return run_training(cfg, ParallelGrid.single(torch.device("cpu")), run_dir)


def dense_copies(results: list[dict], field: str, tied: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Every copy of `field` ("params" or "grads") by dense name, then by where it lives; TP shards joined.

    A TP-sharded tensor gives one copy per DP replica; a TP-replicated one gives one per DP replica and TP
    rank; the last stage's lm_head of a tied model counts as a further copy of the embedding."""
    tp = 1 + max(r["coords"][2] for r in results)
    shards: dict[str, dict[str, dict[int, tuple[torch.Tensor, int | None, int]]]] = {}
    for result in results:
        _, dp_rank, tp_rank = result["coords"]
        for held, (tensor, dim, packed) in result[field].items():
            name = TIED if tied and held == "lm_head.weight" else held
            where = f"{held} dp{dp_rank}" + ("" if dim is not None else f" tp{tp_rank}")
            shards.setdefault(name, {}).setdefault(where, {})[tp_rank] = (tensor, dim, packed)
    copies: dict[str, dict[str, torch.Tensor]] = {}
    for name, places in shards.items():
        for where, parts in places.items():
            _, dim, packed = next(iter(parts.values()))
            if dim is None:
                copies.setdefault(name, {})[where] = next(iter(parts.values()))[0]
                continue
            assert sorted(parts) == list(range(tp)), f"{where}: TP shards {sorted(parts)} of {tp}"
            copies.setdefault(name, {})[where] = join_blocks([parts[t][0] for t in sorted(parts)], dim, packed)
    return copies


def dense_params(results: list[dict], tied: bool = True) -> dict[str, torch.Tensor]:
    """DP replica 0's final parameters by dense name, TP shards joined (a tied lm_head folds into the embedding)."""
    copies = dense_copies(results, "params", tied)
    return {name: next(t for where, t in places.items() if where.split()[1] == "dp0") for name, places in copies.items()}


def _relative_errors(results: list[dict], reference: dict, field: str, dp: int) -> list[tuple[float, str]]:
    """Per-tensor relative error in norm of every copy of `field` against the single process's tensor."""
    expected = {name: t for name, (t, _, _) in reference[field].items()}
    copies = dense_copies(results, field, tied="lm_head.weight" not in expected)
    assert set(copies) == set(expected), f"{field}: names differ: {sorted(set(copies) ^ set(expected))}"
    errors = []
    for name, tensor in expected.items():
        replicas = {where.split(" ")[1] for where in copies[name]}
        assert replicas == {f"dp{d}" for d in range(dp)}, f"{field} {name}: held by {sorted(replicas)} of dp={dp}"
        scale = tensor.norm().item() or 1.0  # a gradient that is exactly zero is compared absolutely
        for where, got in copies[name].items():
            errors.append(((got - tensor).norm().item() / scale, f"{field} {where}"))
    return errors


def _close(what: str, got: list[float], want: list[float], rtol: float) -> list[tuple[float, str]]:
    """(relative error, description) of every step where `got` is not within rtol of `want` (atol 0)."""
    if len(got) != len(want):
        return [(float("inf"), f"{what}: {len(got)} steps, expected {len(want)}")]
    out = []
    for step, (g, w) in enumerate(zip(got, want), start=1):
        error = abs(g - w) / abs(w) if w else abs(g - w)
        if not error <= rtol:
            out.append((error, f"{what} step {step}: {g!r} vs {w!r}, relative error {error:.3g} exceeds {rtol:g}"))
    return out


def step_failures(results: list[dict], reference: dict, tol: Tolerances = FP32) -> list[tuple[float, str]]:
    """Every rank's per-step losses; rank 0's logged loss and aux_loss (rel tol.loss) and grad norm (tol.grad_norm)."""
    failures = [f for result in results for f in _close(f"loss on rank {result['coords']}", result["losses"],
                                                         reference["losses"], tol.loss)]
    logged, want = results[0]["metrics"], reference["metrics"]
    if [m["step"] for m in logged] != [m["step"] for m in want]:
        return [*failures, (float("inf"), "metrics.jsonl: logged steps differ")]
    for key, rtol in (("loss", tol.loss), ("aux_loss", tol.loss), ("grad_norm", tol.grad_norm)):
        failures += _close(f"metrics.jsonl {key}", [m[key] for m in logged], [m[key] for m in want], rtol)
    return failures


def tensor_failures(results: list[dict], reference: dict, tol: Tolerances = FP32) -> list[tuple[float, str]]:
    """Step-1 gradients (rel tol.grad) and final parameters (rel tol.param) of every copy on every DP replica."""
    dp = 1 + max(r["coords"][1] for r in results)
    # Relative in norm, per tensor: Adam's g / (sqrt(v) + eps) turns a rounding-level gradient difference
    # on an entry whose gradient is ~0 into an update difference up to lr * dg / eps, so single entries
    # of a TP layout (different summation order) may differ by ~1e-5 while the tensor agrees to 1e-6.
    return [(error, f"{what}: relative error {error:.3g} exceeds {limit:g}")
            for field, limit in (("grads", tol.grad), ("params", tol.param))
            for error, what in _relative_errors(results, reference, field, dp) if not error <= limit]


def assert_equivalent(results: list[dict], reference: dict, tol: Tolerances = FP32) -> None:
    """The layout computed what one process computes: per-step numbers, step-1 gradients, final parameters.
    A failure lists the worst mismatches first (at most 20)."""
    failures = sorted(step_failures(results, reference, tol) + tensor_failures(results, reference, tol),
                      key=lambda f: -f[0])
    assert not failures, f"{len(failures)} mismatches, worst first:\n" + "\n".join(f for _, f in failures[:20])
