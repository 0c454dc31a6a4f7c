"""The equivalence harness: a layout's training run against one process doing gradient accumulation.

A run records, per step, the loss every rank returns and rank 0's metrics (loss, aux_loss, grad_norm); the
gradients of step 1 (final, synchronised, before clipping) and the final parameters of every rank, each under
its dense name with its TP partition dim. `assert_equivalent` joins TP shards and compares every copy (every
DP replica, every TP rank of a replicated tensor, both copies of a tied embedding) with the single process.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict
from torch.distributed.tensor import DTensor

from parallel.expert import is_expert
from parallel.tensor_pass import join_blocks
from training.config.schema import compose_config

BASE = ["train.seq_len=32", "train.micro_batch_size=2", "data.num_docs=300", "logger=none",
        "train.dtype=fp32", "optim.warmup_steps=1", "optim.lr=1e-3", "train.log_every=1",
        "checkpoint.save_final=false"]  # a test that wants checkpoints asks (checkpoint.every, save_final=true)
TIED = "model.embed_tokens.weight"  # the dense name of a tied embedding/lm_head pair
LOGGED = ("step", "loss", "aux_loss", "grad_norm", "tokens", "val_loss", "val_ppl", "expert_imbalance")  # kept per logged step
# dense name -> (tensor, TP partition dim or None, packing, (ep rank, ep) of a slice of stacked experts or None)
Tensors = dict[str, tuple[torch.Tensor, int | None, int, tuple[int, int] | None]]


@dataclass(frozen=True)
class Tolerances:
    """Relative tolerances: per-step losses, grad norm, and per-tensor norms of gradients and parameters."""

    loss: float = 1e-5
    grad_norm: float = 1e-4
    grad: float = 1e-5
    param: float = 1e-4
    routing: float = 0.0  # expert_imbalance: fp32 routes every token as one process does


FP32 = Tolerances()
EMU = "parallel.emulate=true"  # one process plays every pipeline rank of its (dp, tp) coordinate
BF16_SPREAD = 3.0  # see bf16_tolerances


def bf16_tolerances(bf16: dict, fp32: dict, spread: float = BF16_SPREAD) -> Tolerances:
    """Tolerances of a bf16 layout against the bf16 one-process run `bf16`, derived from how far that run is from the
    fp32 one-process run `fp32` on the same model, data and steps: `spread` x that distance, per quantity (its worst
    step or tensor), never below fp32's.

    Why. bf16 keeps 8 significant bits: every cast under autocast rounds by up to u = 2^-8 relative. A value made of n
    rounded accumulations carries about u * sqrt(n) of it, and each step feeds the last one's rounding into the next
    (the weights are cast again). A layout sums the same fp32 products in another order (the DP reduction, the tied
    pair's two copies, TP's all-reduce of bf16 partial products, ep's grouped matmuls), so some casts land on the other
    side of a bf16 midpoint: a difference of one fp32 ulp (2^-24) flips a cast lying that near one, which happens on
    some machines and seeds and not others (tests/test_families.py's Qwen3 bf16 case with train.seed=39: grad norm
    2.2e-4 and parameters 2.1e-4 off one process on an AMD EPYC; seed 0 there: 4e-9). From that step on the layout is
    a second bf16 rounding of the same computation, as far from the exact (fp32) numbers as the reference is, d, so the
    two are at most 2d apart (the triangle inequality); the spread of d between two roundings makes it 3d. d is
    measured here, not guessed: it holds u, the accumulations and the steps of exactly this run. A layout that computes
    fp32 numbers is d from the reference, within 3d: callers also check that it is nearer its bf16 reference than the
    fp32 one (`distance`)."""
    def worst_step(key: str) -> float:
        at = [i for i, m in enumerate(fp32["metrics"]) if key in m]
        got, want = [bf16["metrics"][i][key] for i in at], [fp32["metrics"][i][key] for i in at]
        return max((error for error, _ in _close(key, got, want, 0.0)), default=0.0)

    per_rank = max((error for error, _ in _close("loss", bf16["losses"], fp32["losses"], 0.0)), default=0.0)
    loss = max(per_rank, worst_step("loss"), worst_step("aux_loss"))
    tensor = {f: max(e for e, _ in _relative_errors([bf16], fp32, f, 1)) for f in ("grads", "params")}
    return Tolerances(loss=max(FP32.loss, spread * loss),
                      grad_norm=max(FP32.grad_norm, spread * worst_step("grad_norm")),
                      grad=max(FP32.grad, spread * tensor["grads"]),
                      param=max(FP32.param, spread * tensor["params"]),
                      routing=max(FP32.routing, spread * worst_step("expert_imbalance")))


@dataclass(frozen=True)
class Layout:
    """One equivalence case: `run` overrides the baseline shares, `layout` overrides only the layout has."""

    name: str
    run: list[str]
    layout: list[str]
    world: int  # processes: dp * tp * pp, or dp * tp when emulated
    dp: int
    tol: Tolerances = FP32

    @property
    def emulated(self) -> bool:
        return EMU in self.layout


def compose_run_config(overrides: list[str], cache_dir: Path) -> DictConfig:
    """The run config train.py would compose for these overrides."""
    return compose_config([*BASE, f"data.cache_dir={cache_dir}", *overrides])


def _snapshot(named: dict, grads: bool) -> Tensors:
    """Copies of this rank's parameters (or their gradients, zeros where none) with their TP partition dim."""
    out = {}
    for name, p in named.items():
        tensor = p.grad if grads else p
        tensor = torch.zeros_like(p) if tensor is None else tensor
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # FSDP's shards (zero=2/3), gathered
        out[name] = (tensor.detach().float().cpu().clone(), getattr(p, "partition_dim", None), getattr(p, "tp_packed", 1),
                     getattr(p, "expert_block", None))
    return out


def fingerprint(tensors: list[torch.Tensor]) -> str:
    """A short digest of tensors' bytes (which samples a micro-batch holds, or an RNG state)."""
    digest = hashlib.sha1()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class RecordedBatches:
    """The trainer's step stream, noting a fingerprint of every micro-batch it hands out (what a replica read)."""

    def __init__(self, inner, log: list[list[str]]):
        self.inner, self.log = inner, log

    def __iter__(self):
        return self

    def __next__(self):
        micro_batches = next(self.inner)
        self.log.append([fingerprint([mb.input_ids, mb.labels]) for mb in micro_batches])
        return micro_batches

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def run_training(cfg: DictConfig, grid, run_dir: Path) -> dict:
    """Train; return losses, rank 0's metrics, step-1 gradients, the final parameters, the tied copies, and per
    step the micro-batches read (fingerprints) and the RNG state after the step."""
    from training.trainer import Trainer

    trainer = Trainer(cfg, grid, run_dir)
    data: list[list[str]] = []
    trainer.data = RecordedBatches(trainer.data, data)
    rng: list[str] = []
    tied_copies = []  # the first stage's embedding or the last stage's lm_head after every step
    grads: Tensors = {}

    def record_grads(step: int) -> None:
        if step == 1:
            grads.update(_snapshot(trainer.engine.named_parameters(), grads=True))

    def record_step(step: int) -> None:
        rng.append(fingerprint([torch.get_rng_state()]))
        named = trainer.engine.named_parameters()
        for name in (TIED, "lm_head.weight"):
            if name in named:
                tied_copies.append((step, name, named[name].detach().cpu().clone()))

    losses = trainer.fit(on_step=record_step, on_grads=record_grads)
    metrics = None
    if grid.rank == 0:  # only global rank 0 writes metrics.jsonl
        lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        metrics = [{k: line[k] for k in LOGGED if k in line} for line in lines]
    experts = sorted(n for n, p in trainer.engine.named_parameters().items() if is_expert(p))
    return {"losses": losses, "metrics": metrics, "grads": grads, "coords": (grid.pp_rank, grid.dp_rank, grid.tp_rank),
            "ep": grid.ep, "experts": experts, **shard_sizes(trainer.engine.named_parameters()),
            "params": _snapshot(trainer.engine.named_parameters(), grads=False), "tied": tied_copies,
            "data": data, "rng": rng}


def shard_sizes(named: dict) -> dict:
    """Each parameter's element count, and this rank's part of those FSDP shards (parallel.zero=2/3)."""
    return {"whole_numel": {n: p.numel() for n, p in named.items()},
            "sharded": {n: p.to_local().numel() for n, p in named.items() if isinstance(p, DTensor)}}


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
        grid = ParallelGrid.build(p.dp, p.tp, 1 if p.emulate else p.pp, backend="gloo", timeout_s=120, ep=p.ep)
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
    """Every copy of `field` ("params" or "grads") by dense name, then by where it lives; TP shards joined, and the
    slices of stacked experts of one ep group (named after its first DP rank).

    A TP-sharded tensor gives one copy per DP replica; a TP-replicated one gives one per DP replica and TP
    rank; the last stage's lm_head of a tied model counts as a further copy of the embedding."""
    tp = 1 + max(r["coords"][2] for r in results)
    shards: dict[str, dict[str, dict[tuple[int, int], tuple]]] = {}
    for result in results:
        _, dp_rank, tp_rank = result["coords"]
        for held, (tensor, dim, packed, block) in result[field].items():
            name = TIED if tied and held == "lm_head.weight" else held
            ep_rank = block[0] if block else 0
            where = f"{held} dp{dp_rank - ep_rank}" + ("" if dim is not None else f" tp{tp_rank}")
            shards.setdefault(name, {}).setdefault(where, {})[ep_rank, tp_rank] = (tensor, dim, packed, block)
    copies: dict[str, dict[str, torch.Tensor]] = {}
    for name, places in shards.items():
        for where, parts in places.items():
            _, dim, packed, block = next(iter(parts.values()))
            ep = block[1] if block else 1
            assert {e for e, _ in parts} == set(range(ep)), f"{where}: expert slices {sorted(parts)} of ep={ep}"
            slices = []
            for e in range(ep):
                blocks = {t: tensor for (ee, t), (tensor, *_) in parts.items() if ee == e}
                if dim is None:
                    slices.append(next(iter(blocks.values())))
                    continue
                assert sorted(blocks) == list(range(tp)), f"{where}: TP shards {sorted(blocks)} of {tp}"
                slices.append(join_blocks([blocks[t] for t in sorted(blocks)], dim, packed))
            copies.setdefault(name, {})[where] = torch.cat(slices) if ep > 1 else slices[0]
    return copies


def dense_params(results: list[dict], tied: bool = True) -> dict[str, torch.Tensor]:
    """The lowest DP replica's final parameters by dense name (replica 0's, but for an EP-split expert the first
    replica holding it), TP shards joined (a tied lm_head folds into the embedding)."""
    copies = dense_copies(results, "params", tied)
    return {name: min(places.items(), key=lambda item: int(item[0].split()[1][2:]))[1]
            for name, places in copies.items()}


def _relative_errors(results: list[dict], reference: dict, field: str, dp: int) -> list[tuple[float, str]]:
    """Per-tensor relative error in norm of every copy of `field` against the single process's tensor."""
    expected = {name: t for name, (t, *_) in reference[field].items()}
    copies = dense_copies(results, field, tied="lm_head.weight" not in expected)
    assert set(copies) == set(expected), f"{field}: names differ: {sorted(set(copies) ^ set(expected))}"
    experts = {name for r in results for name in r.get("experts", ())}
    ep = max(r.get("ep", 1) for r in results)
    errors = []
    for name, tensor in expected.items():
        replicas = {where.split(" ")[1] for where in copies[name]}
        if name in experts:  # EP: held by the dp / ep replicas of one ep rank
            holders = {int(r[2:]) % ep for r in replicas}
            assert len(replicas) == dp // ep and len(holders) == 1, f"{field} {name}: held by {sorted(replicas)}"
        else:
            assert replicas == {f"dp{d}" for d in range(dp)}, f"{field} {name}: held by {sorted(replicas)} of dp={dp}"
        scale = tensor.norm().item() or 1.0  # a gradient that is exactly zero is compared absolutely
        for where, got in copies[name].items():
            errors.append(((got - tensor).norm().item() / scale, f"{field} {where}"))
    return errors


def _close(what: str, got: list[float], want: list[float], rtol: float,
           steps: list[int] | None = None) -> list[tuple[float, str]]:
    """(relative error, description) of every step where `got` is not within rtol of `want` (atol 0)."""
    if len(got) != len(want):
        return [(float("inf"), f"{what}: {len(got)} steps, expected {len(want)}")]
    out = []
    for step, g, w in zip(steps or range(1, len(want) + 1), got, want):
        error = abs(g - w) / abs(w) if w else abs(g - w)
        if not error <= rtol:
            out.append((error, f"{what} step {step}: {g!r} vs {w!r}, relative error {error:.3g} exceeds {rtol:g}"))
    return out


def data_failures(results: list[dict], reference: dict) -> list[tuple[float, str]]:
    """Per step, the micro-batches every DP replica read together are the ones the single process read."""
    by_replica = {r["coords"][1]: r["data"] for r in sorted(results, key=lambda r: r["coords"])}
    failures = []
    for step, want in enumerate(reference["data"], start=1):
        got = sorted(f for log in by_replica.values() if step <= len(log) for f in log[step - 1])
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        if got != sorted(want):
            failures.append((float("inf"), f"data step {step}: the replicas read {len(got)} micro-batches, "
                                           f"{len(extra)} of them not the single process's ({len(missing)} of its "
                                           f"{len(want)} unread, or read twice)"))
    return failures


def step_failures(results: list[dict], reference: dict, tol: Tolerances = FP32) -> list[tuple[float, str]]:
    """Every rank's per-step losses; rank 0's logged loss and aux_loss (rel tol.loss), grad norm (tol.grad_norm),
    label tokens (exact), validation loss and MoE load (tol.routing); the micro-batches the replicas read."""
    failures = [f for result in results for f in _close(f"loss on rank {result['coords']}", result["losses"],
                                                         reference["losses"], tol.loss)]
    logged, want = results[0]["metrics"], reference["metrics"]
    if [m["step"] for m in logged] != [m["step"] for m in want]:
        return [*failures, (float("inf"), "metrics.jsonl: logged steps differ")]
    for key, rtol in (("loss", tol.loss), ("aux_loss", tol.loss), ("grad_norm", tol.grad_norm), ("tokens", 0.0),
                      ("val_loss", tol.loss), ("expert_imbalance", tol.routing)):
        at = [i for i, m in enumerate(want) if key in m]
        failures += _close(f"metrics.jsonl {key}", [logged[i].get(key, float("nan")) for i in at],
                           [want[i][key] for i in at], rtol, [want[i]["step"] for i in at])
    return failures + data_failures(results, reference)


def tensor_failures(results: list[dict], reference: dict, tol: Tolerances = FP32) -> list[tuple[float, str]]:
    """Step-1 gradients (rel tol.grad) and final parameters (rel tol.param) of every copy on every DP replica."""
    dp = 1 + max(r["coords"][1] for r in results)
    # Relative in norm, per tensor: Adam's g / (sqrt(v) + eps) turns a rounding-level gradient difference
    # on an entry whose gradient is ~0 into an update difference up to lr * dg / eps, so single entries
    # of a TP layout (different summation order) may differ by ~1e-5 while the tensor agrees to 1e-6.
    return [(error, f"{what}: relative error {error:.3g} exceeds {limit:g}")
            for field, limit in (("grads", tol.grad), ("params", tol.param))
            for error, what in _relative_errors(results, reference, field, dp) if not error <= limit]


def distance(results: list[dict], reference: dict) -> float:
    """How far a layout's final parameters are from a reference run's, as one relative norm over every copy of every
    tensor (to tell which of two references it is nearer). One norm, not the worst tensor: under TP, bf16 rounds
    partial products and moves a few small tensors as far as bf16 itself does, while the whole model stays nearer
    its bf16 reference (tp2-pp2: 1.5e-3 against 1.9e-3 from fp32; a worst tensor says 7.6e-3 against 7.3e-3)."""
    expected = {name: t.double() for name, (t, *_) in reference["params"].items()}
    copies = dense_copies(results, "params", tied="lm_head.weight" not in expected)
    off = sum((got.double() - expected[name]).pow(2).sum().item() for name in expected for got in copies[name].values())
    size = sum(expected[name].pow(2).sum().item() * len(copies[name]) for name in expected)
    return (off / size) ** 0.5


def _quantity(failure: str) -> str:
    """What a failure line is about, without where and when: `grads model.x.weight`, `metrics.jsonl tokens`."""
    return re.split(r" step \d| dp\d|:", failure, maxsplit=1)[0]


def assert_params_match_plain_loop(result: dict, want: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    """A one-process run's trained parameters against a plain PyTorch loop's, each within `rtol` in norm."""
    params = {name: tensor for name, (tensor, *_) in result["params"].items()}
    for name, tensor in want.items():
        error = ((params[name] - tensor).norm() / tensor.norm()).item()
        assert error <= rtol, f"parameter {name} differs from the plain loop by {error:.3g}"


def assert_equivalent(results: list[dict], reference: dict, tol: Tolerances = FP32) -> None:
    """The layout computed what one process computes: per-step numbers, the data read, step-1 gradients, final
    parameters. A failure names every quantity that differs, each with its worst mismatch, worst first."""
    failures = sorted(step_failures(results, reference, tol) + tensor_failures(results, reference, tol),
                      key=lambda f: -f[0])
    worst: dict[str, str] = {}
    for _, line in failures:
        worst.setdefault(_quantity(line), line)
    assert not failures, (f"{len(failures)} mismatches in {len(worst)} quantities; the worst of each, worst first:\n"
                          + "\n".join(list(worst.values())[:60]))


def assert_equivalent_bf16(results: list[dict], reference: dict, fp32: dict) -> None:
    """A bf16 layout against its bf16 one-process `reference`: within `bf16_tolerances`, and nearer that reference than
    the fp32 one-process run `fp32` (the tolerances alone would pass a layout that computed fp32 numbers)."""
    assert_equivalent(results, reference, bf16_tolerances(reference, fp32))
    assert distance(results, reference) < distance(results, fp32), (distance(results, reference),
                                                                     distance(results, fp32))


def resume_failures(straight: list[dict], resumed: list[dict], start: int) -> list[str]:
    """Bit for bit, per rank, after step `start`: each step's loss, the micro-batches it read and the RNG state
    after it; then every final parameter. Each failure names what differs."""
    out = []
    for full, tail in zip(straight, resumed):
        where = f"rank {tail['coords']}"
        if len(tail["losses"]) != len(full["losses"]) - start:
            out.append(f"the resumed run on {where} ran {len(tail['losses'])} steps, not {len(full['losses']) - start}")
        for what, values in (("loss", "losses"), ("data", "data"), ("rng state after", "rng")):
            for step, (want, got) in enumerate(zip(full[values][start:], tail[values]), start=start + 1):
                if want != got:
                    out.append(f"{what} step {step} of the resumed run on {where} differs from the uninterrupted run's"
                               if what != "rng state after" else
                               f"rng state after step {step} of the resumed run on {where} differs from the "
                               "uninterrupted run's")
        for name, (tensor, *_) in full["params"].items():
            if not torch.equal(tensor, tail["params"][name][0]):
                out.append(f"params {name} on {where}: not bit for bit after the resume")
    return out


def assert_bitwise_resume(straight: list[dict], resumed: list[dict], start: int) -> None:
    """A run resumed after step `start` continues the uninterrupted run bit for bit (see `resume_failures`)."""
    failures = resume_failures(straight, resumed, start)
    assert not failures, f"{len(failures)} differences, first ones:\n" + "\n".join(failures[:20])
