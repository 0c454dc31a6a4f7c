"""Stage, runtime and transport: the I/W split equals B, sent activations are freed, any feasible list runs.

Most tests run every pipeline rank in this process (the emulation transport); the live-memory test spawns.
"""

import dataclasses
import gc
import random
import weakref

import pytest
import torch

from minimind import MiniMindConfig, MiniMindForCausalLM
from models import decoder_of
from parallel.decoder import Decoder
from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.pipeline.actions import Action, Kind
from parallel.pipeline.lowering import lower
from parallel.pipeline.schedules import SCHEDULES, RegisteredSchedule
from parallel.pipeline.simulate import simulate
from parallel.pipeline.stage import Stage
from parallel.pipeline.transport import EmulationError
from parallel.spec import EngineSpec, PipelineSpec
from training.specs import default_engine_spec
from parallel.step import LocalEngine, MicroBatch, dense_token_loss
from training.objectives.lm import LANGUAGE_MODEL
from tests.spawn import run_workers
from tests.test_schedules import random_feasible

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741
CPU = torch.device("cpu")




def tiny(layers: int = 4, moe: bool = False, seed: int = 0) -> Decoder:
    """A tiny MiniMind (dense or MoE) as the parallel layer sees it."""
    torch.manual_seed(seed)
    return decoder_of(MiniMindForCausalLM(MiniMindConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers,
                                                         num_attention_heads=4, num_key_value_heads=2, use_moe=moe,
                                                         num_experts=4, router_aux_loss_coef=0.01)))


def batches(m: int, seed: int = 1) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(seed)
    return [MicroBatch(ids, ids.clone()) for ids in torch.randint(0, 128, (m, 2, 16), generator=gen)]


def layout_cfg(schedule: str, pp: int, m: int, vpp: int = 1) -> EngineSpec:
    """The engine spec of a tiny pipeline, emulating every pipeline rank here."""
    return default_engine_spec(PipelineSpec(pp=pp, vpp=vpp, schedule=schedule, n_microbatches=m),
                      micro_batch_size=2, seq_len=16, timeout_s=30, emulate=True)


def dense_grads(decoder: Decoder, mbs: list[MicroBatch]) -> dict[str, torch.Tensor]:
    """Gradients of one process doing gradient accumulation over `mbs` (the reference)."""
    LocalEngine(decoder, CPU, torch.float32, LANGUAGE_MODEL).step(mbs)
    return {name: p.grad for name, p in decoder.module.named_parameters()}


def assert_grads_match(engine: ParallelEngine, reference: dict[str, torch.Tensor]) -> None:
    for name, param in engine.named_parameters().items():
        expected = reference["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-7, msg=name)


# --- The I/W split. ----------------------------------------------------------------------------------------


def run_b_and_i(full: Decoder, split: Decoder, data: list[MicroBatch]) -> tuple[Stage, Stage]:
    """One-stage pipelines of both models after every micro-batch's F, then B (full) or I (split): W pending."""
    a = Stage(full, 0, 1, CPU, torch.float32, dense_token_loss, objective=LANGUAGE_MODEL)
    b = Stage(split, 0, 1, CPU, torch.float32, dense_token_loss, split_backward=True, objective=LANGUAGE_MODEL)
    for mb, batch in enumerate(data):
        for stage in (a, b):
            stage.forward(mb, batch.input_ids, batch.labels, 0.01, 0.5)
    for mb in range(len(data)):
        a.backward(mb, None)
        b.backward_input(mb, None)
    return a, b


@pytest.mark.parametrize("moe", [False, True])
def test_input_then_weight_backward_equals_full_backward(moe):
    full, split = tiny(moe=moe), tiny(moe=moe)
    a, b = run_b_and_i(full, split, batches(2))
    # After I: the linear layers' weights wait for W; norms and the embedding already have theirs.
    waiting = {n for n, p in split.module.named_parameters() if p.grad is None}
    assert waiting and all(n.endswith("proj.weight") or n.endswith("gate.weight") for n in waiting), waiting
    assert b.live() == 2 and not b.saved  # W's inputs are what is still held
    for mb in range(2):
        b.backward_weight(mb)
    assert b.live() == 0 and b.peak_live == 2
    for (name, p), q in zip(full.module.named_parameters(), split.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_stage_drops_the_boundary_activation_once_it_is_handed_over():
    model = tiny()
    stage = Stage(model.prune(range(1, 3), False, False), 1, 3, CPU, torch.float32, dense_token_loss)
    x = torch.randn(2, 16, 32)
    out = stage.forward(0, x, None, 1.0, 1.0)
    shape, alive = out.shape, weakref.ref(out)
    del out  # what the runtime does once the send completed
    gc.collect()
    assert alive() is None  # the stage kept the autograd node, not the [B, S, H] tensor
    assert stage.backward(0, torch.ones(shape)).shape == shape


# --- Any feasible list, lowered, runs to the single-process gradients. -----------------------------------


def test_random_feasible_schedules_give_single_process_gradients(monkeypatch):
    rng = random.Random(3)
    mbs = batches(4)
    reference = dense_grads(tiny(layers=6), mbs)
    for trial in range(8):
        pp, m = rng.randint(2, 3), rng.randint(1, 4)
        placement, vpp = rng.choice([("loop", 1), ("loop", 2), ("v", 2)])
        compute = random_feasible(rng, pp, m, vpp, placement, split=trial % 2 == 1)
        monkeypatch.setitem(SCHEDULES, "random", RegisteredSchedule(lambda *_, c=compute: c, placement, (vpp, vpp)))
        engine = ParallelEngine(layout_cfg("random", pp, m, vpp), tiny(layers=6), ParallelGrid.single(CPU))
        engine.step(mbs[:m])
        want = reference if m == 4 else dense_grads(tiny(layers=6), mbs[:m])
        assert_grads_match(engine, want)


def test_v_placement_ties_embedding_and_head_into_one_parameter(monkeypatch):
    engine = ParallelEngine(layout_cfg("1f1b", 2, 2), tiny(), ParallelGrid.single(CPU))
    assert engine.first is not engine.head  # looped: two copies, summed every step
    monkeypatch.setitem(SCHEDULES, "v", RegisteredSchedule(lambda pp, m, vpp: _v_gpipe(pp, m), "v", (2, 2)))
    engine = ParallelEngine(layout_cfg("v", 2, 2, vpp=2), tiny(), ParallelGrid.single(CPU))
    assert engine.first is engine.head
    assert engine.stages[0].module.model.embed_tokens.weight is engine.stages[3].module.lm_head.weight
    assert "lm_head.weight" not in engine.named_parameters()  # one Parameter, named once


def _v_gpipe(pp: int, m: int) -> list[list[Action]]:
    """All forwards down and up the V, then all backwards (the simplest V schedule)."""
    out = []
    for r in range(pp):
        down, up = r, 2 * pp - 1 - r
        out.append([Action(F, i, s) for s in (down, up) for i in range(m)]
                   + [Action(B, i, s) for s in (up, down) for i in range(m)])
    return out


def test_a_receive_blocks_only_its_consumer():
    # Rank 0 posts RECV_B0 before F1 but needs it only at B0. Waiting for the whole batch (the lowering's
    # stricter model) would deadlock: rank 1 makes B0's gradient only after it got F1 from rank 0.
    S, R = Kind.SEND_F, Kind.RECV_F
    rank0 = [Action(F, 0, 0), Action(S, 0, 0), Action(Kind.RECV_B, 0, 0), Action(F, 1, 0), Action(S, 1, 0),
             Action(Kind.RECV_B, 1, 0), Action(B, 0, 0), Action(B, 1, 0)]
    rank1 = [Action(R, 0, 1), Action(F, 0, 1), Action(R, 1, 1), Action(F, 1, 1), Action(B, 0, 1),
             Action(Kind.SEND_B, 0, 1), Action(B, 1, 1), Action(Kind.SEND_B, 1, 1)]
    engine = ParallelEngine(layout_cfg("gpipe", 2, 2), tiny(), ParallelGrid.single(CPU))
    engine.lists = {0: rank0, 1: rank1}
    engine.step(batches(2))
    assert_grads_match(engine, dense_grads(tiny(), batches(2)))


# --- Faults the emulation names instead of hanging or corrupting. ------------------------------------------


def test_emulation_names_the_ranks_of_a_deadlock():
    engine = ParallelEngine(layout_cfg("1f1b", 2, 2), tiny(), ParallelGrid.single(CPU))
    # Rank 1 runs F1 before B0, but rank 0 makes F1 only after B0's gradient came back: a cycle.
    compute = [[Action(F, 0, 0), Action(B, 0, 0), Action(F, 1, 0), Action(B, 1, 0)],
               [Action(F, 0, 1), Action(F, 1, 1), Action(B, 0, 1), Action(B, 1, 1)]]
    engine.lists = dict(enumerate(lower(compute, 2, 2, "loop")))
    with pytest.raises(EmulationError, match=r"deadlock: rank 0, slot \d+, B0@s0 waits for RECV_B0@s0 from rank 1; "
                                             r"rank 1, slot \d+, F1@s1 waits for RECV_F1@s1 from rank 0"):
        engine.step(batches(2))


def test_emulation_catches_messages_swapped_on_a_channel():
    engine = ParallelEngine(layout_cfg("gpipe", 2, 2), tiny(), ParallelGrid.single(CPU))
    rank1 = list(engine.lists[1])
    rank1.remove(Action(Kind.RECV_F, 1, 1))
    rank1.insert(rank1.index(Action(Kind.RECV_F, 0, 1)), Action(Kind.RECV_F, 1, 1))
    engine.lists = {**engine.lists, 1: rank1}
    # Rank 1 now posts RECV_F1 first: a real channel would hand it micro-batch 0's activation, silently.
    with pytest.raises(EmulationError, match="out of order"):
        engine.step(batches(2))


def test_trace_records_every_action_of_every_rank():
    engine = ParallelEngine(layout_cfg("1f1b", 2, 3), tiny(), ParallelGrid.single(CPU))
    trace = engine.step(batches(3), trace=True).trace
    assert sorted(trace) == [0, 1]
    for rank, records in trace.items():
        assert [a for a, _, _ in records] == engine.lists[rank]
        assert all(0 <= start <= end for _, start, end in records)


# --- Live activations, measured across processes (acceptance 6). -----------------------------------------


def peaks_worker(rank: int, world_size: int, schedules: list[str], m: int) -> dict[str, int]:
    """Build the pp=world layout for each schedule, run one step, return this rank's peak live micro-batches."""
    grid = ParallelGrid.build(None, 1, world_size, backend="gloo", timeout_s=60)
    peaks = {}
    for name in schedules:
        cfg = layout_cfg(name, world_size, m)
        cfg = dataclasses.replace(cfg, emulate=False)
        engine = ParallelEngine(cfg, tiny(layers=world_size), grid)
        engine.step(batches(m))
        peaks[name] = engine.peak_live()[grid.pp_rank]
    return peaks


def test_live_activations_follow_the_schedule():
    pp, m = 4, 8
    names = [n for n in ("1f1b", "gpipe", "zb-h1") if n in SCHEDULES]
    results = run_workers(peaks_worker, pp, names, m, timeout=120)
    for name in names:
        measured = [r[name] for r in results]
        registered = SCHEDULES[name]
        lowered = lower(registered.generate(pp, m, 1), pp, pp, registered.placement)
        assert measured == simulate(lowered, pp, pp, m, registered.placement).peak_live, name
    assert [r["1f1b"] for r in results] == [min(pp - r, m) for r in range(pp)] == [4, 3, 2, 1]
    assert [r["gpipe"] for r in results] == [m] * pp
