"""Generation as a schedule: greedy equals transformers' `generate`, every layout equals one process token for token
(greedy and seeded sampling), and the verifier refuses a generation list that would deadlock."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from models import decoder_of
from parallel.engine import build_engine
from parallel.generation import Rollout, Sampling, Sequences, pick, prompt_positions
from parallel.grid import ParallelGrid
from parallel.pipeline.actions import Action, Kind
from parallel.pipeline.generation import generation_lists, verify_generation
from parallel.pipeline.rollouts import generate_in_layout
from parallel.pipeline.static_rules import ScheduleError
from parallel.spec import PipelineSpec
from tests.spawn import run_workers
from tests.test_conformance import family_config
from training.specs import default_engine_spec

CPU = torch.device("cpu")
PROMPT, NEW = 7, 8  # prompt length, max_new_tokens
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=5)


def family_model(preset: str, seed: int = 0) -> torch.nn.Module:
    """transformers' own model of a preset (SDPA, eval), its weights moved far enough from their initial values that
    greedy completions vary token to token."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(preset), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return model


def left_padded(vocab: int, rows: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [rows, PROMPT] with some rows left-padded (pad id 0), and their mask."""
    prompts = torch.randint(3, vocab, (rows, PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(prompts, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, :1] = False
    return prompts.masked_fill(~mask, 0), mask


def engine_of(model: torch.nn.Module, grid: ParallelGrid | None = None, pp: int = 1, schedule: str = "1f1b",
              vpp: int = 1, **changes):
    """The step engine of a layout on `model`'s weights (one process unless `grid` or pp says otherwise)."""
    spec = default_engine_spec(PipelineSpec(pp=pp, vpp=vpp, schedule=schedule, n_microbatches=max(2, pp * vpp)),
                               micro_batch_size=2, seq_len=16, timeout_s=60, **changes)
    return build_engine(spec, decoder_of(model), grid or ParallelGrid.single(CPU))


def with_eos(rollout: Rollout) -> int:
    """A token the greedy completions emit early in row 1: as EOS, rows stop at different steps."""
    return int(rollout.tokens[1, PROMPT + 2])


def assert_same(a: Rollout, b: Rollout) -> None:
    """Token for token, the same masks; log-probs within float32 reordering."""
    assert torch.equal(a.tokens, b.tokens), (a.tokens, b.tokens)
    assert torch.equal(a.completion_mask, b.completion_mask) and torch.equal(a.prompt_mask, b.prompt_mask)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=1e-4)


# --- one process against transformers ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "qwen3-moe-tiny"])
def test_greedy_equals_transformers_generate(preset):
    """Left-padded batch, without and with EOS: the same tokens, the same length (stops when every row did)."""
    model = family_model(preset)
    prompts, mask = left_padded(model.config.vocab_size)
    engine = engine_of(model)
    moe = {"output_router_logits": False} if "moe" in preset else {}  # its aux loss fails on a padded generate
    free = engine.generate(prompts, mask, Sampling(NEW, temperature=0))
    eos = with_eos(free)
    for eos_id in (None, eos):
        ours = engine.generate(prompts, mask, Sampling(NEW, temperature=0, eos_token_id=eos_id))
        theirs = model.generate(prompts, attention_mask=mask.long(), do_sample=False, max_new_tokens=NEW,
                                pad_token_id=0, eos_token_id=eos_id, **moe)
        assert torch.equal(ours.tokens, theirs), (preset, eos_id, ours.tokens, theirs)
    assert not ours.completion_mask.all()  # EOS stopped a row early (pad after it, as generate pads)
    assert (ours.log_probs[~ours.completion_mask] == 0).all() and (ours.log_probs[ours.completion_mask] < 0).all()
    assert model.training is False and all(not m.training for m in model.modules())


def test_sliding_window_caches_equal_transformers_generate():
    """Gemma3 (sliding and full layers, a rotary table each): prompt and completion past its 16-token window, in one
    process and in an emulated pp2 whose stages hold different kinds of layers."""
    model = family_model("gemma3-tiny")
    prompts, mask = left_padded(model.config.vocab_size)
    prompts, mask = torch.cat([prompts, prompts.flip(1)], 1), torch.cat([mask, mask.flip(1) | True], 1)
    sampling = Sampling(12, temperature=0)
    theirs = model.generate(prompts, attention_mask=mask.long(), do_sample=False, max_new_tokens=12, pad_token_id=0,
                            eos_token_id=None)
    assert prompts.shape[1] + 12 > model.config.sliding_window
    assert torch.equal(engine_of(model).generate(prompts, mask, sampling).tokens, theirs)
    assert torch.equal(engine_of(model, pp=2, emulate=True).generate(prompts, mask, sampling).tokens, theirs)


def test_generation_leaves_training_mode_and_grads_alone():
    model = family_model("tiny").train()
    engine = engine_of(model)
    prompts, mask = left_padded(model.config.vocab_size)
    engine.generate(prompts, mask, Sampling(2, temperature=0))
    assert all(m.training for m in engine.chunks()[0].module.modules())
    assert all(p.grad is None for p in engine.parameters())


def test_sampling_is_per_row_and_step():
    """A row's token depends on its global id, its step and the seed, not on the rows beside it."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(1, **SAMPLED)
    tokens, log_probs = pick(logits, sampling, [10, 11, 12, 13], step=3)
    alone, _ = pick(logits[2:3], sampling, [12], step=3)
    assert tokens[2] == alone[0]
    assert not torch.equal(tokens, pick(logits, dataclasses.replace(sampling, seed=6), [10, 11, 12, 13], 3)[0])
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])
    greedy, _ = pick(logits, Sampling(1, temperature=0), [0, 1, 2, 3], 0)
    assert torch.equal(greedy, logits.argmax(-1))


def test_bad_prompts_are_refused_in_one_line():
    engine = engine_of(family_model("tiny"))
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.tensor([[True, True, True], [True, True, False]])
    with pytest.raises(ValueError, match="must be left-padded"):
        engine.generate(ids, mask, Sampling(2))
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate(ids[:, :0], mask[:, :0], Sampling(2))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.generate(ids, mask | True, Sampling(0))
    context = engine.chunks()[0].config.max_position_embeddings
    with pytest.raises(ValueError, match=f"over the model's {context} positions"):
        engine.generate(ids, mask | True, Sampling(context))


def test_positions_and_mask_follow_generate():
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert prompt_positions(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    seqs = Sequences(mask, [0, 1], cache=None)
    seqs.advance(4)
    args = seqs.forward_args(1)
    assert args["positions"].tolist() == [[2], [4]] and args["attention_mask"].shape == (2, 5)


# --- layouts in one process -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "qwen3-moe-tiny"])
def test_emulated_pipelines_equal_one_process(preset):
    """pp2 and pp3 (fewer micro-batches than... and as many as stages), interleaved and V placements, rounds of 3
    ticks (the round's last token carried to the next): greedy and sampled, with EOS, token for token."""
    model = family_model(preset)
    prompts, mask = left_padded(model.config.vocab_size)
    one = engine_of(model)
    eos = with_eos(one.generate(prompts, mask, Sampling(NEW, temperature=0)))
    layouts = [engine_of(model, pp=2, emulate=True), engine_of(model, pp=3, emulate=True),
               engine_of(model, pp=2, vpp=2, schedule="interleaved-1f1b", emulate=True),
               engine_of(model, pp=2, vpp=2, schedule="zbv", emulate=True)]
    for sampling in (Sampling(NEW, temperature=0, eos_token_id=eos), Sampling(NEW, eos_token_id=eos, **SAMPLED)):
        expected = one.generate(prompts, mask, sampling)
        for layout in layouts:
            assert_same(expected, generate_in_layout(layout, prompts, mask, sampling, ticks_per_round=3))
        assert_same(expected, layouts[0].generate(prompts, mask, sampling))  # the engine's own call, one round


def test_a_micro_batch_past_eos_drops_out_at_the_round_end():
    """pp2, micro-batches of rows {0, 1} and {2, 3}: with an EOS only the first two rows emit, the first micro-batch
    stops running at the end of the round it finished in (fewer head calls), and the tokens stay one process's."""
    model = family_model("tiny")
    prompts, mask = left_padded(model.config.vocab_size, rows=4)
    one = engine_of(model)
    free = one.generate(prompts, mask, Sampling(12, temperature=0)).tokens[:, PROMPT:]
    eos = min(set(free[0].tolist()) & set(free[1].tolist()) - set(free[2:].flatten().tolist()))
    sampling = Sampling(12, temperature=0, eos_token_id=eos)
    layout = engine_of(model, pp=2, emulate=True)
    calls = []
    last = layout.chunks()[-1]
    hook = last.module.get_submodule(last.plan.head).register_forward_hook(lambda *_: calls.append(1))
    try:
        assert_same(one.generate(prompts, mask, sampling), generate_in_layout(layout, prompts, mask, sampling,
                                                                              ticks_per_round=3))
    finally:
        hook.remove()
    assert len(calls) < 2 * 12, len(calls)  # without the drop both micro-batches run all 12 ticks (here 9 + 12)


# --- the schedule and its verifier ----------------------------------------------------------------------------------


def test_generation_lists_verify_for_many_shapes():
    for pp in (1, 2, 3, 4):
        for m in (1, 2, pp, pp + 1):
            for ticks in (1, 2, 5):
                generation_lists(pp, pp, "loop", m, ticks)
    generation_lists(2, 4, "loop", 2, 3)
    generation_lists(2, 4, "v", 2, 3)


def _broken(lists, rank: int, move: str, before: int) -> list[list[Action]]:
    """`lists` with rank's action `move` put at slot `before`."""
    out = [list(actions) for actions in lists]
    action = Action.parse(move)
    out[rank].remove(action)
    out[rank].insert(before, action)
    return out


def test_verifier_refuses_a_deadlocking_generation_list():
    """Rank 0 waits for the token of tick 1 before it sends the tick-0 activations that token needs."""
    lists = generation_lists(2, 2, "loop", 2, 2)
    assert [str(a) for a in lists[0][:3]] == ["F0@s0", "SEND_F0@s0", "F1@s0"]
    broken = _broken(_broken(lists, 0, "RECV_T2@s0", 1), 0, "SEND_F0@s0", 3)  # F0 RECV_T2 F1 SEND_F0 ...
    deadlock = r"deadlock: rank 0, slot 1, RECV_T2@s0 waits for rank 1 to post SEND_T0@s1"
    with pytest.raises(ScheduleError, match=deadlock):
        verify_generation(broken, 2, 2, "loop", 2, 2)


def test_verifier_names_static_faults():
    lists = generation_lists(2, 2, "loop", 2, 2)
    early = _broken(lists, 0, "F2@s0", 0)
    with pytest.raises(ScheduleError, match=r"rank 0, slot 0, F2@s0: runs before the token of tick 0 arrives"):
        verify_generation(early, 2, 2, "loop", 2, 2)
    missing = [list(lists[0]), [a for a in lists[1] if str(a) != "F3@s1"]]
    with pytest.raises(ScheduleError, match=r"F3@s1"):
        verify_generation(missing, 2, 2, "loop", 2, 2)
    backward = [list(lists[0]), [*lists[1], Action(Kind.B, 0, 1)]]
    with pytest.raises(ScheduleError, match="generation has no backward"):
        verify_generation(backward, 2, 2, "loop", 2, 2)


# --- world-2 layouts in one spawn ------------------------------------------------------------------------------------


def _layouts_worker(rank: int, world_size: int) -> dict:
    """Each layout's rollout of this rank (its replica's rows), and one process's on the whole batch."""
    layouts = {  # name -> (preset, grid sizes (dp, tp, pp, ep), engine changes)
        "dp2": ("tiny", (2, 1, 1, 1), {}),
        "pp2": ("tiny", (1, 1, 2, 1), {"pp": 2}),
        "tp2 x pp2": ("llama-tiny", (1, 2, 1, 1), {"pp": 2, "emulate": True}),
        "ep2": ("qwen3-moe-tiny", (2, 1, 1, 2), {}),
        "ep2 x pp2": ("qwen3-moe-tiny", (2, 1, 1, 2), {"pp": 2, "emulate": True}),
    }
    out = {}
    for name, (preset, (dp, tp, pp, ep), changes) in layouts.items():
        model = family_model(preset)
        prompts, mask = left_padded(model.config.vocab_size, rows=4)
        one = engine_of(model)
        eos = with_eos(one.generate(prompts, mask, Sampling(NEW, temperature=0)))
        grid = ParallelGrid.build(dp, tp, pp, backend="gloo", timeout_s=60, ep=ep)
        engine = engine_of(model, grid, **changes)
        rows = slice(grid.dp_rank * 2, grid.dp_rank * 2 + 2) if dp > 1 else slice(None)
        for sampling in (Sampling(NEW, temperature=0, eos_token_id=eos), Sampling(NEW, eos_token_id=eos, **SAMPLED)):
            # Sampled: rounds of 3 ticks (the round-end broadcast carries each round's first tokens).
            ours = (generate_in_layout(engine, prompts[rows], mask[rows], sampling, ticks_per_round=3)
                    if sampling.temperature else engine.generate(prompts[rows], mask[rows], sampling))
            out[name, sampling.temperature] = (ours, one.generate(prompts, mask, sampling), rows)
    return out


def test_world2_layouts_equal_one_process():
    """dp2 (each replica its rows), pp2 over P2P, tp2 x pp2 (vocab-parallel logits gathered), ep2 and ep2 x pp2:
    every rank's completions are one process's, greedy and seeded sampling."""
    results = run_workers(_layouts_worker, 2, timeout=300)
    for rank, result in enumerate(results):
        for (name, temperature), (ours, one, rows) in result.items():
            expected = Rollout(one.tokens[rows], one.prompt_mask[rows], one.completion_mask[rows], one.log_probs[rows])
            n = int(expected.completion_mask.sum(1).max())  # a replica stops when its own rows did
            expected = Rollout(expected.tokens[:, :PROMPT + n], expected.prompt_mask, expected.completion_mask[:, :n],
                               expected.log_probs[:, :n])
            try:
                assert_same(ours, expected)
            except AssertionError as error:
                raise AssertionError(f"rank {rank}, {name}, temperature {temperature}: {error}") from None


# --- make preview ----------------------------------------------------------------------------------------------------


def test_preview_draws_a_generation_schedule(tmp_path, capsys):
    from tests.test_preview import load_preview_module

    out = tmp_path / "generate.png"
    assert load_preview_module().main(["--generate", "model=tiny", "parallel.pp=4", "schedule.n_microbatches=4",
                                    "--ticks=3", f"--out={out}"]) == 0
    text = capsys.readouterr().out
    assert "rank 3  | .   .   .   F0  F1" in text and "bubble fraction 20.0%" in text  # 12 forwards in 15 units
    assert "SEND_T0@s3" in text and "RECV_T4@s0" in text and out.stat().st_size > 0


# --- scripts/generate.py on a training checkpoint ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run's directory: one step, its checkpoint saved with the tokenizer (in this process)."""
    from tests.equivalence import compose_run_config
    from training.trainer import Trainer

    root = tmp_path_factory.mktemp("trained")
    cfg = compose_run_config(["model=tiny", "train.steps=1", "checkpoint.save_final=true"], root / "cache")
    Trainer(cfg, ParallelGrid.single(CPU), root / "run").fit()
    return root / "run"


def test_generate_script_takes_a_checkpoint_and_a_layout(trained, capsys):
    from tests.test_scripts import script

    generate = script("generate")
    argv = [str(trained), "the cat", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3"]
    assert generate.main(argv) == 0
    one = capsys.readouterr().out
    assert generate.main([*argv, "--layout", "parallel.pp=2", "parallel.emulate=true"]) == 0
    assert capsys.readouterr().out == one and one.strip()
    assert generate.main([*argv, "--layout", "parallel.pp=two"]) == 2
    assert "--layout parallel.pp=two: parallel.pp is a positive whole number" in capsys.readouterr().err
    assert generate.main([*argv, "--layout", "parallel.tp=3"]) == 2  # refused before any worker starts
    assert "--layout parallel.tp=3 does not divide the model's num_attention_heads=4" in capsys.readouterr().err


def test_a_checkpoints_greedy_completion_equals_transformers_on_its_weights(trained):
    from checkpoint.export import build_model, read_merged_weights
    from training.launch.generation_run import Layout, layout_engine

    state, meta = read_merged_weights(trained)
    model = build_model(meta["model"], state)
    prompts, mask = left_padded(model.config.vocab_size, rows=3)
    engine = layout_engine(state, meta, Layout(), ParallelGrid.single(CPU), prompts.shape[1])
    ours = engine.generate(prompts, mask, Sampling(NEW, temperature=0))
    theirs = model.generate(prompts, attention_mask=mask.long(), do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                            eos_token_id=None)
    assert torch.equal(ours.tokens, theirs)
