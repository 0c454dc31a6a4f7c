"""Defects found in review, each pinned by a test that fails on the code before its fix."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from minimind.model import MoEFeedForward
from parallel.engine import ParallelEngine
from parallel.grad_norm import global_grad_norm
from parallel.grid import ParallelGrid
from parallel.pipeline.transport import BoundaryMismatch
from parallel.step import LocalEngine, MicroBatch
from tests.conftest import ROOT
from tests.spawn import run_workers
from tests.test_runtime import CPU, batches, layout_cfg, tiny
from training.objectives.lm import LANGUAGE_MODEL


def _untouched_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE forward that skips experts without tokens (as many MoE codes do): they get no gradient at all."""
    tokens = x.reshape(-1, x.shape[-1])
    scores = torch.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(scores, self.top_k, dim=-1)
    out = torch.zeros_like(tokens)
    for expert_id, expert in enumerate(self.experts):
        token_idx, slot = torch.where(chosen == expert_id)
        if token_idx.numel():
            out = out.index_add(0, token_idx, expert(tokens[token_idx]) * weights[token_idx, slot, None])
    return out.view(x.shape), tokens.new_zeros(())


def _moe_dp_worker(rank: int, world_size: int) -> dict:
    """dp2, pp1: replica 1 feeds one repeated token, so top-1 routing sends every position to one expert and
    the other experts get no gradient there, while replica 0 (random tokens) gives every expert one."""
    with pytest.MonkeyPatch.context() as mp:  # a pooled worker runs other tests next: undo the patch
        mp.setattr(MoEFeedForward, "forward", _untouched_experts)
        grid = ParallelGrid.build(None, 1, 1, backend="gloo", timeout_s=60)
        spec = dataclasses.replace(layout_cfg("1f1b", 1, 2), emulate=False)
        engine = ParallelEngine(spec, tiny(moe=True), grid)
        engine.step(replica_batches(rank))
        return {name: p.grad for name, p in engine.named_parameters().items()}


def replica_batches(dp_rank: int) -> list[MicroBatch]:
    if dp_rank == 0:
        return batches(2)
    same = torch.full((2, 2, 16), 5)
    return [MicroBatch(ids, ids.clone()) for ids in same]


def test_dp_sum_zero_fills_gradients_a_replica_never_made(monkeypatch):
    results = run_workers(_moe_dp_worker, 2, timeout=180)
    absent = [n for n, g in results[1].items() if g is None]
    model = tiny(moe=True)
    single = tiny(moe=True)
    monkeypatch.setattr(MoEFeedForward, "forward", _untouched_experts)
    LocalEngine(single, CPU, torch.float32, LANGUAGE_MODEL).step(replica_batches(1))
    assert any(p.grad is None for p in single.module.parameters())  # the premise: replica 1 alone leaves some out
    LocalEngine(model, CPU, torch.float32, LANGUAGE_MODEL).step(replica_batches(0) + replica_batches(1))
    for name, param in model.module.named_parameters():
        for rank in (0, 1):
            torch.testing.assert_close(results[rank][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert not absent  # every rank ends the step with every gradient, summed


def test_a_boundary_of_the_wrong_shape_is_refused_naming_both_stages():
    engine = ParallelEngine(layout_cfg("1f1b", 2, 2), tiny(), ParallelGrid.single(CPU))
    _, layer = engine.stages[0].chunk.blocks()[-1]  # the stage's last layer makes its boundary activation
    forward = layer.forward
    layer.forward = lambda *a, **k: (lambda out: (out[0][:, :-1], out[1]))(forward(*a, **k))  # drops a position
    with pytest.raises(BoundaryMismatch, match=r"stage 0 sends stage 1 a activation of shape \(2, 15, 32\) "
                                               r"torch.float32 for micro-batch 0, but the boundary is \(2, 16, 32\)"):
        engine.step(batches(2))


def test_grad_norm_accumulates_on_the_compute_device_without_gradients():
    params = [torch.nn.Parameter(torch.zeros(3, device="meta"))]
    assert global_grad_norm(params, None, torch.device("meta")).device.type == "meta"


def test_no_runtime_invariant_is_an_assert_statement_so_all_hold_under_python_dash_O():
    """`python -O` strips assert statements: a check the runtime relies on (a stage refusing a reset with micro-batches
    that never ran backward, a schedule's validation) must raise an error instead. No product module holds one."""
    import ast

    files = [path for package in ("minimind", "models", "parallel", "checkpoint", "training")
             for path in (ROOT / package).rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in files
             for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Assert)]
    assert not found, f"assert statements vanish under python -O; raise an error instead: {found}"
    assert ast.Assert in {type(n) for n in ast.walk(ast.parse("assert x"))}  # the scan sees one where there is one


def test_a_failure_after_the_rendezvous_still_destroys_the_process_group(monkeypatch):
    from omegaconf import OmegaConf

    from training.launch import workers as launch
    from tests.spawn import rendezvous_store

    store = rendezvous_store(60)  # held here: the process group joins it as a client, no port is re-bound
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    def build(*args, **kwargs):
        dist.init_process_group("gloo", rank=0, world_size=1)
        raise RuntimeError("mesh failed")

    monkeypatch.setattr(ParallelGrid, "build", build)
    cfg = OmegaConf.create({"parallel": {"dp": None, "tp": 1, "pp": 1, "ep": 1, "emulate": False, "backend": "gloo",
                                         "timeout_s": 10, "startup_timeout_s": 10, "layout": None}})
    with pytest.raises(RuntimeError, match="mesh failed"):
        launch.run_worker(OmegaConf.to_container(cfg), "unused")
    assert not dist.is_initialized()


def test_a_tied_pth_gives_every_parameter_its_own_storage(tmp_path):
    from checkpoint.dense_source import dense_source

    model = tiny()
    torch.save(model.module.state_dict(), tmp_path / "tied.pth")  # embedding and head: one storage in the file
    shapes = {n: tuple(t.shape) for n, t in model.module.state_dict().items()}
    source = dense_source(tmp_path / "tied.pth", shapes, model.plan.ties)
    embedding, head = source("model.embed_tokens.weight", shapes["model.embed_tokens.weight"]), \
        source("lm_head.weight", shapes["lm_head.weight"])
    assert torch.equal(embedding, head)
    assert embedding.untyped_storage().data_ptr() != head.untyped_storage().data_ptr()


def test_a_tp_block_does_not_pin_the_dense_tensor():
    from parallel.decoder import Decoder
    from parallel.materialize import materialize_

    module = torch.nn.Module()
    with torch.device("meta"):
        module.w = torch.nn.Parameter(torch.empty(2, 4))
    module.w.tensor_parallel, module.w.partition_dim = True, 0
    no_buffers = SimpleNamespace(init_buffers=lambda module: None)  # the one adapter hook materialize_ calls
    materialize_(Decoder(module, None, no_buffers), lambda name, shape: torch.arange(16.0).view(shape), 1, 2, CPU)
    assert module.w.untyped_storage().nbytes() == 8 * 4  # its 2 x 4 block, not the 4 x 4 dense tensor
    assert module.w.tolist() == [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]] and module.w.tensor_parallel
