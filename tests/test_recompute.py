"""Activation recomputation: same numbers as none (pp2, MoE, dropout, the I/W split), names kept, less saved."""

import copy

import pytest
import torch
from torch import nn

from minimind import MiniMindConfig, MiniMindForCausalLM
from models import decoder_of
from models.minimind import saved_activation_bytes_per_layer
from parallel.decoder import Decoder
from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.stage import Stage
from parallel.recompute import MODES, apply_recompute
from parallel.spec import PipelineSpec
from training.specs import default_engine_spec
from parallel.step import MicroBatch, dense_token_loss
from parallel.tensor import vocab_parallel_cross_entropy
from parallel.tensor_pass import apply_tensor_parallel
from tests.spawn import run_workers
from tests.test_runtime import run_b_and_i
from training.objectives.lm import LANGUAGE_MODEL, shifted_loss_sum

CPU = torch.device("cpu")




def config(layers: int = 4, moe: bool = False, dropout: float = 0.0) -> MiniMindConfig:
    return MiniMindConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, use_moe=moe, num_experts=4, num_experts_per_tok=2,
                          router_aux_loss_coef=0.01, dropout=dropout)


def tiny(layers: int = 4, moe: bool = False, dropout: float = 0.0, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return decoder_of(MiniMindForCausalLM(config(layers, moe, dropout)))


def batches(m: int, seq: int = 16, seed: int = 1) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(seed)
    return [MicroBatch(ids, ids.clone()) for ids in torch.randint(0, 128, (m, 2, seq), generator=gen)]


class SavedBytes:
    """Saved-tensor hooks that count the bytes autograd holds for backward (each storage once, parameters not
    at all) and keep the peak: a tensor stops counting when autograd frees the node that saved it."""

    def __init__(self, params: list[nn.Parameter], skip=lambda tensor: False):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.skip = skip  # tensors that are not activations either (under autocast: the weights' casts)
        self.live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.current = self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _pack(self, tensor: torch.Tensor) -> "_Held":
        key = tensor.untyped_storage().data_ptr()
        if key in self.params or self.skip(tensor):
            return _Held(tensor, None)
        entry = self.live.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(tensor, lambda: self._release(key))

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


class _Held:
    """A saved tensor that tells its meter when autograd lets go of it."""

    def __init__(self, tensor: torch.Tensor, release):
        self.tensor, self.release = tensor, release

    def __del__(self):
        if self.release is not None:
            self.release()


def engine(mode: str, moe: bool = False, seq: int = 16, schedule: str = "1f1b", m: int = 4,
           dropout: float = 0.0) -> ParallelEngine:
    """A pp2 engine emulated in this process, its stage modules passed through `apply_recompute(mode)`."""
    vpp = SCHEDULES[schedule].default_vpp
    spec = default_engine_spec(PipelineSpec(pp=2, vpp=vpp, schedule=schedule, n_microbatches=m), micro_batch_size=2,
                      seq_len=seq, timeout_s=30, emulate=True)
    built = ParallelEngine(spec, tiny(moe=moe, dropout=dropout), ParallelGrid.single(CPU))
    for stage in built.stages.values():
        apply_recompute(stage.chunk, mode)
    return built


def metered(built: ParallelEngine) -> dict[int, SavedBytes]:
    """Count the saved bytes of each stage's forwards (the runtime calls `stage.forward`)."""
    meters = {}
    for index, stage in built.stages.items():
        meter = meters[index] = SavedBytes(list(stage.module.parameters()))

        def forward(*args, _meter=meter, _forward=stage.forward, **kwargs):
            with _meter.hooks():
                return _forward(*args, **kwargs)

        stage.forward = forward
    return meters


def grads(built: ParallelEngine) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in built.named_parameters().items()}


def assert_close_rel(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in actual.items():
        scale = expected[name].abs().max().clamp_min(1e-12)
        assert ((grad - expected[name]).abs().max() / scale).item() <= rel, name


# --- The same numbers. ------------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True])
def test_recomputation_at_pp2_gives_the_losses_and_gradients_of_none(moe):
    mbs = batches(4)
    reference = engine("none", moe)
    expected = reference.step(mbs)
    for mode in ("full", "selective"):
        built = engine(mode, moe)
        result = built.step(mbs)
        assert abs(result.loss - expected.loss) <= 1e-6 * abs(expected.loss), mode
        assert abs(result.aux_loss - expected.aux_loss) <= 1e-6 * max(abs(expected.aux_loss), 1e-12), mode
        assert_close_rel(grads(built), grads(reference), 1e-6)


def test_recomputation_replays_the_dropout_masks_of_the_forward():
    mbs = batches(2)
    torch.manual_seed(5)
    reference = engine("none", dropout=0.2, m=2)
    torch.manual_seed(7)
    expected = reference.step(mbs)
    for mode in ("full", "selective"):
        built = engine(mode, dropout=0.2, m=2)
        torch.manual_seed(7)
        assert built.step(mbs).loss == pytest.approx(expected.loss, rel=1e-6), mode
        assert_close_rel(grads(built), grads(reference), 1e-6)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_input_then_weight_backward_with_recomputation_equals_full_backward_without(mode, moe):
    full, split = tiny(moe=moe), apply_recompute(tiny(moe=moe), mode)
    _, b = run_b_and_i(full, split, batches(2))
    # The recomputed linears ran under SplitLinears: their weight gradients still wait for W.
    waiting = {n for n, p in split.module.named_parameters() if p.grad is None}
    assert any(".layers." in n and n.endswith("proj.weight") for n in waiting), waiting
    assert all(len(b.weight_grads.pending[mb]) > 0 for mb in range(2))
    for mb in range(2):
        b.backward_weight(mb)
    assert_close_rel({n: p.grad for n, p in split.module.named_parameters()},
                     {n: p.grad for n, p in full.module.named_parameters()}, 1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_bf16_autocast_recomputes_the_same_numbers(mode):
    """Recompute reruns the same bf16 kernels on the same inputs in the same order: exact in bf16, so the fp32-level
    bound (1e-6) needs no bf16 tolerance."""
    plain, patched = tiny(moe=True), apply_recompute(tiny(moe=True), mode)
    losses = []
    for model in (plain, patched):
        stage = Stage(model, 0, 1, CPU, torch.bfloat16, dense_token_loss, split_backward=True,
                      objective=LANGUAGE_MODEL)
        for mb, batch in enumerate(batches(2)):
            stage.forward(mb, batch.input_ids, batch.labels, 0.01, 0.5)
            stage.backward_input(mb, None)
            stage.backward_weight(mb)
        losses.append(stage.loss_sums[0].item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert_close_rel({n: p.grad for n, p in patched.module.named_parameters()},
                     {n: p.grad for n, p in plain.module.named_parameters()}, 1e-6)


@pytest.mark.parametrize("schedule", sorted(set(SCHEDULES) - {"1f1b"}))
def test_every_schedule_runs_with_recomputation(schedule):
    mbs = batches(4)
    reference = engine("none", schedule=schedule)
    expected = reference.step(mbs).loss
    for mode in ("full", "selective"):
        built = engine(mode, schedule=schedule)
        assert built.step(mbs).loss == pytest.approx(expected, rel=1e-6), mode
        assert_close_rel(grads(built), grads(reference), 1e-6)


# --- Names and the pass itself. ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_pass_keeps_every_dense_name_and_survives_a_deepcopy(mode):
    model = tiny(moe=True)
    names = [n for n, _ in model.module.named_parameters()]
    keys = list(model.module.state_dict())
    apply_recompute(model, mode)
    assert [n for n, _ in model.module.named_parameters()] == names
    assert list(model.module.state_dict()) == keys
    assert "model.layers.3.mlp.experts.1.up_proj.weight" in names
    # A copy's patched forwards run the copy's weights, not the original's.
    twin, plain = copy.deepcopy(model), tiny(moe=True)
    with torch.no_grad():
        for p, q in zip(twin.module.parameters(), plain.module.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    ids = batches(1)[0].input_ids
    torch.testing.assert_close(twin(input_ids=ids)[0], plain(input_ids=ids)[0], rtol=0, atol=0)


def test_a_bad_mode_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"train.recompute='some' .* none\|full\|selective"):
        apply_recompute(tiny(), "some")
    assert MODES == ("none", "full", "selective")


def test_applying_twice_is_refused():
    model = apply_recompute(tiny(), "full")
    with pytest.raises(RuntimeError, match="runs once"):
        apply_recompute(model, "full")


# --- What is saved. ---------------------------------------------------------------------------------------


def test_saved_activations_per_stage_at_seq_256_full_halves_selective_lowers():
    mbs = batches(4, seq=256)
    peaks = {}
    for mode in MODES:
        built = engine(mode, seq=256)
        meters = metered(built)
        built.step(mbs)
        peaks[mode] = {s: meter.peak for s, meter in meters.items()}
    for s in (0, 1):
        full, selective = peaks["full"][s] / peaks["none"][s], peaks["selective"][s] / peaks["none"][s]
        print(f"stage {s}: none {peaks['none'][s]} B, full {full:.3f}x, selective {selective:.3f}x")
        assert full <= 0.5 and selective < 1.0, (s, peaks)


def measured_layer_bytes(cfg: MiniMindConfig, mode: str, dtype: torch.dtype, seq: int = 48,
                         grid: ParallelGrid | None = None) -> int:
    """Saved bytes of one decoder layer's forward (training mode), parameters and their casts excluded."""
    torch.manual_seed(0)
    decoder = decoder_of(MiniMindForCausalLM(cfg))
    model = apply_recompute(apply_tensor_parallel(decoder, grid) if grid is not None else decoder, mode).module
    layer, base = model.model.layers["0"], model.model
    weight_shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    meter = SavedBytes(list(model.parameters()),
                       skip=lambda t: t.dtype != torch.float32 and tuple(t.shape) in weight_shapes)
    x = torch.randn(2, seq, cfg.hidden_size, requires_grad=True)
    positions = torch.arange(seq)[None]
    cos, sin = base.rope_cos[positions], base.rope_sin[positions]
    with meter.hooks(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out, aux = layer(x, cos, sin)
    return meter.current - 2 * cos.untyped_storage().nbytes()  # RoPE tables: one pair per stage, not per layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moe", [False, True])
def test_the_memory_model_is_what_the_hooks_count(moe, dtype):
    cfg = config(layers=1, moe=moe)
    for mode in MODES:
        predicted = saved_activation_bytes_per_layer(cfg, 2, 48, dtype.itemsize, mode)
        assert measured_layer_bytes(cfg, mode, dtype) == predicted, (mode, dtype)
    assert saved_activation_bytes_per_layer(cfg, 2, 48, 2, "selective", tp=2) < predicted


def _tp_worker(rank: int, world_size: int) -> dict:
    grid = ParallelGrid.build(dp=1, tp=world_size, pp=1, backend="gloo", timeout_s=60)
    out: dict = {}
    ids = batches(1)[0].input_ids
    for moe in (False, True):
        for mode in MODES:
            model = apply_recompute(apply_tensor_parallel(tiny(moe=moe), grid), mode)
            logits, aux_loss = model(input_ids=ids)
            width = logits.shape[-1]
            loss = shifted_loss_sum(logits, ids, lambda x, t: vocab_parallel_cross_entropy(
                x, t, grid.tp_group, grid.tp_rank * width)) + aux_loss
            loss.backward()
            out[moe, mode] = {"loss": loss.item(), "grads": {n: p.grad for n, p in model.module.named_parameters()}}
            cfg = config(layers=1, moe=moe)
            out[moe, mode]["bytes"] = (measured_layer_bytes(cfg, mode, torch.float32, grid=grid),
                                       saved_activation_bytes_per_layer(cfg, 2, 48, 4, mode, tp=world_size))
    return out


def test_recomputation_of_tp2_shards_gives_the_numbers_of_none_and_its_memory_model():
    for result in run_workers(_tp_worker, 2, timeout=180):
        for moe in (False, True):
            expected = result[moe, "none"]
            for mode in MODES:
                got = result[moe, mode]
                assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6), (moe, mode)
                assert_close_rel(got["grads"], expected["grads"], 1e-6)
                assert got["bytes"][0] == got["bytes"][1], (moe, mode)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_engine_spec_recompute_reaches_every_stage(mode):
    import dataclasses

    from tests.test_runtime import CPU, batches, layout_cfg, tiny

    plain = ParallelEngine(layout_cfg("zb-h1", 2, 4), tiny(moe=True), ParallelGrid.single(CPU)).step(batches(4))
    spec = dataclasses.replace(layout_cfg("zb-h1", 2, 4), recompute=mode)
    engine = ParallelEngine(spec, tiny(moe=True), ParallelGrid.single(CPU))
    assert engine.step(batches(4)).loss == plain.loss
    with pytest.raises(RuntimeError, match="already has a patched forward"):
        apply_recompute(engine.stages[0].chunk, mode)  # the engine applied it once


def _family_decoder(preset: str) -> Decoder:
    """The dense decoder of a registered transformers family's preset, on the meta device."""
    from models.family import build_model as build_module, model_config

    return decoder_of(build_module(model_config({"name": preset, "hf_config": f"models/configs/{preset}"})))


def test_a_part_whose_role_the_adapter_cannot_name_is_one_line_at_start_and_tp_layers_keep_their_roles():
    from parallel.recompute import GatedActivation, SdpaCore, unknown_roles

    moe = _family_decoder("qwen3-moe-tiny")  # its stacked experts: no activation module to recompute
    assert unknown_roles(moe) == [
        "train.recompute=selective: qwen3_moe's Qwen3MoeSparseMoeBlock has no MLP activation its adapter names (in 4 "
        "layers): it is kept saved, not recomputed; name its role in the family adapter's selective_recompute"]
    llama = _family_decoder("llama-tiny")
    assert unknown_roles(llama) == []
    layer = llama.blocks()[0][1]
    layer.mlp.gate_proj = nn.Identity()  # as the TP pass leaves it: a ColumnParallelLinear, not an nn.Linear
    assert [type(t) for t in llama.adapter.selective_recompute(layer)] == [SdpaCore, GatedActivation]


class _Counted(nn.Module):
    """An activation function that counts its calls."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act, self.calls = act, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.act(x)


def test_a_packed_gate_up_mlp_recomputes_its_activation_with_the_same_gradients():
    """Phi-3's MLP packs [gate | up] in one projection: selective recompute runs its activation again in backward (once
    per layer in forward, once more in backward) and every gradient is what no recompute gives, bit for bit."""
    from models.family import build_model as build_module, model_config
    from parallel.recompute import PackedGatedActivation

    torch.manual_seed(0)
    dense = decoder_of(build_module(model_config({"hf_config": "models/configs/phi3-tiny"}), "cpu"))
    assert [type(t) for t in dense.adapter.selective_recompute(dense.blocks()[0][1])][-1] is PackedGatedActivation
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    found = {}
    for mode in ("none", "selective"):
        decoder = Decoder(copy.deepcopy(dense.module), dense.plan, dense.adapter)
        counters = []
        for _, layer in decoder.blocks():
            layer.mlp.activation_fn = _Counted(layer.mlp.activation_fn)
            counters.append(layer.mlp.activation_fn)
        apply_recompute(decoder, mode)
        logits, _ = decoder(input_ids=ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        found[mode] = ([c.calls for c in counters], {n: p.grad for n, p in decoder.module.named_parameters()})
    assert found["none"][0] == [1] * 4 and found["selective"][0] == [2] * 4
    for name, grad in found["none"][1].items():
        assert torch.equal(found["selective"][1][name], grad), name
