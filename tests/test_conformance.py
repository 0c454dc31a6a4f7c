"""Every registered family equals its own transformers class, not only itself in another layout.

For each preset of each entry of `models.registry.FAMILIES` (generated, no hand list), Sluice's model is built as the
engine builds it (on the meta device, by the engine's chunk passes: pruned into two pipeline chunks, TP-sharded,
materialised from a weight source) and compared with `AutoModelForCausalLM.from_config` holding the same weights:
logits, the LM loss and every gradient (fp32, 1e-6 of the tensor's scale), every buffer equal to a normally built model's, and the
seeded initial values following the class's own `_init_weights` (mean, std and zeros per tensor). tp=1 runs in this
process, tp=2 on the session's pool of two processes, one job per preset when a selected test first asks for it: a
family's mistake fails that family's tests only, and `-k <family>` runs that family's job alone. The MoE router's
load-balancing loss is left out of the gradients: Sluice takes it per layer (pipeline stages), transformers pools every
layer (`_balance_loss`).

The three silent Gemma3 mistakes of issue 36 are kept as mutants (each reverts one fix): each must fail here.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

from models import build_model, decoder_of
from models.gemma3 import Gemma3Adapter
from models.phi3 import Phi3Adapter
from models.registry import FAMILIES, Family, RegistryError, registry
from models.transformers_decoder import TransformersDecoderAdapter
from parallel import materialize, tensor_pass
from parallel.collectives import all_gather_cat
from parallel.decoder import ContractError
from parallel.grid import ParallelGrid
from parallel.materialize import materialize_, seeded_init
from parallel.passes import chunk_passes
from parallel.pipeline.build import rank_chunks
from parallel.pipeline.lowered import lower_pipeline
from parallel.spec import PipelineSpec
from parallel.tensor import vocab_parallel_cross_entropy
from parallel.tensor_pass import join_blocks, shard_modules
from tests.equivalence import compose_run_config
from tests.shared import once_per_session
from tests.spawn import run_workers
from training.config import model_config
from training.specs import default_engine_spec

pytestmark = pytest.mark.timeout(900)

PRESETS = [preset for family in FAMILIES.values() for preset in family.presets]
# fp32, relative to each tensor's scale. One process runs transformers' own ops in its order (measured: 0 to 2e-7);
# TP's all-reduces and the vocab-split loss sum in another order (measured: up to 2.0e-6 in a gradient).
TOLERANCE = {1: 1e-6, 2: 1e-5}
NOISE_FLOOR = 1e-2  # of the model's largest gradient: below it a gradient is rounding noise (a top-1 router's ~1e-9)
SEED = 5


def family_config(preset: str):
    """The transformers config a run with `model=<preset>` trains."""
    return model_config(compose_run_config([f"model={preset}"], Path("unused-cache")))


def reference(config) -> nn.Module:
    """transformers' own model (`from_config`, SDPA), its weights moved off their initial values (Gemma's zero
    norms, the ones elsewhere) so that every weight counts in the comparison."""
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def batch(config) -> torch.Tensor:
    """Token ids [2, 32] (longer than the presets' 16-token sliding windows)."""
    return torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(SEED))


def reference_run(preset: str) -> dict:
    """transformers' logits, its own loss function's LM loss, its gradients, and a normally built model's buffers."""
    config = family_config(preset)
    model, ids = reference(config), batch(config)
    extra = {"output_router_logits": False} if hasattr(config, "output_router_logits") else {}
    out = model(input_ids=ids, labels=ids, **extra)
    out.loss.backward()
    fresh = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return {"logits": out.logits.detach(), "loss": out.loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}, "buffers": dict(fresh.named_buffers())}


def _dense(tensor: torch.Tensor, param: nn.Parameter, grid: ParallelGrid) -> torch.Tensor:
    """The dense tensor of a TP-sharded parameter's block (joined over the TP group); itself when whole."""
    if not getattr(param, "tensor_parallel", False):
        return tensor.detach().clone()
    blocks = [torch.empty_like(tensor) for _ in range(grid.tp)]
    dist.all_gather(blocks, tensor.detach().contiguous(), group=grid.tp_group)
    return join_blocks(blocks, param.partition_dim, getattr(param, "tp_packed", 1))


def sluice_run(preset: str, grid: ParallelGrid) -> dict:
    """Sluice's model of the preset as the engine builds it (meta, two pipeline chunks, the TP pass, materialised
    from the reference's weights): dense logits, LM loss, gradients (tied copies summed) and buffers."""
    config = family_config(preset)
    weights, ids = reference(config).state_dict(), batch(config)
    spec = default_engine_spec(PipelineSpec(pp=2, schedule="1f1b", n_microbatches=2), 1, ids.shape[1])
    pipeline, decoder = lower_pipeline(spec.pipeline, config.num_hidden_layers), decoder_of(build_model(config))
    passes = chunk_passes(spec, lambda name, shape: weights[name].clone())
    first, last = (rank_chunks(pipeline, decoder, grid, rank, passes)[rank] for rank in (0, 1))
    with counted_gathers() as gathers:
        hidden, _ = first(input_ids=ids)
        logits, _ = last(hidden=hidden)
        width = logits.shape[-1]
        losses = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], grid.tp_group, grid.tp_rank * width)
        loss = losses.mean()
        loss.backward()
    grads: dict[str, torch.Tensor] = {}
    for chunk in (first, last):
        for name, param in chunk.module.named_parameters():
            name = chunk.plan.ties.get(name, name)  # a tied copy's gradient joins its source's
            grad = _dense(param.grad, param, grid)
            grads[name] = grads[name] + grad if name in grads else grad
    full = all_gather_cat(logits.detach(), grid.tp_group, dim=-1)
    buffers = {n: b.clone() for chunk in (first, last) for n, b in chunk.module.named_buffers()}
    return {"logits": full.detach(), "loss": loss.detach(), "grads": grads, "buffers": buffers,
            "gathers": sum(gathers)}


@contextmanager
def counted_gathers():
    """Count the all-gathers torch.distributed runs inside the block (forward and backward): yields a list that
    gets a 1 per call."""
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("all_gather", "all_gather_into_tensor"):
            real = getattr(dist, name)
            mp.setattr(dist, name, lambda *args, _real=real, **kwargs: calls.append(1) or _real(*args, **kwargs))
        yield calls


def _scaled_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    """max |actual - expected| over max |expected| (at least `floor`: a gradient may be ~0 elementwise); inf on a
    shape mismatch."""
    if actual.shape != expected.shape:
        return math.inf
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


def problems(got: dict, expected: dict, tp: int = 1) -> list[str]:
    """What differs between Sluice's run and transformers', one line each (empty: conformant)."""
    found, tolerance = [], TOLERANCE[tp]
    for key in ("logits", "loss"):
        if not (error := _scaled_error(got[key], expected[key])) <= tolerance:
            found.append(f"{key}: relative error {error:.3g}")
    if got["grads"].keys() != expected["grads"].keys():
        found.append(f"gradients: other names {sorted(got['grads'].keys() ^ expected['grads'].keys())}")
    floor = NOISE_FLOOR * max(g.abs().max().item() for g in expected["grads"].values())
    for name in got["grads"].keys() & expected["grads"].keys():
        if not (error := _scaled_error(got["grads"][name], expected["grads"][name], floor)) <= tolerance:
            found.append(f"gradient of {name}: relative error {error:.3g}")
    for name, buffer in got["buffers"].items():
        normal = expected["buffers"].get(name)
        if normal is None or not torch.equal(buffer, normal):
            found.append(f"buffer {name}: {buffer.flatten()[:4].tolist()} where a normally built model holds "
                         f"{None if normal is None else normal.flatten()[:4].tolist()}")
    return sorted(found)


def init_problems(preset: str) -> list[str]:
    """Where the seeded initial values (what a run starts from) do not follow the class's own `_init_weights`: per
    tensor, a constant must be that constant, a random tensor have its mean, std and exact zeros (a padding row)."""
    config = family_config(preset)
    decoder = decoder_of(build_model(config))
    init = seeded_init(decoder, SEED)
    torch.manual_seed(SEED)
    own = dict(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").named_parameters())
    found = []
    for name, param in decoder.module.named_parameters():
        ours, theirs = init(name, tuple(param.shape)).double(), own[name].detach().double()
        n, std = theirs.numel(), theirs.std().item() if theirs.numel() > 1 else 0.0
        if std == 0.0:
            if not torch.equal(ours, theirs):
                found.append(f"init of {name}: {ours.flatten()[:3].tolist()}, the class gives the constant "
                             f"{theirs.flatten()[0].item()}")
            continue
        mean_ok = abs(ours.mean().item() - theirs.mean().item()) <= 6 * std / math.sqrt(n)
        std_ok = 0.75 <= ours.std().item() / std <= 1.33
        zeros_ok = (ours == 0).sum().item() == (theirs == 0).sum().item()
        if not (mean_ok and std_ok and zeros_ok):
            found.append(f"init of {name}: mean {ours.mean().item():.3g} std {ours.std().item():.3g} zeros "
                         f"{(ours == 0).sum().item()}, the class gives mean {theirs.mean().item():.3g} std {std:.3g} "
                         f"zeros {(theirs == 0).sum().item()}")
    return found


# --- the three Gemma3 mistakes, each the revert of one fix ------------------------------------------------------------

def tp_plain_embedding(mp: pytest.MonkeyPatch) -> None:
    """The TP pass turns any nn.Embedding subclass into a plain VocabParallelEmbedding (Gemma3's scale dropped)."""
    mp.setattr(tensor_pass, "_keeping_behaviour", lambda name, module, parallel, adapter: parallel)


def empty_buffers(mp: pytest.MonkeyPatch) -> None:
    """Meta buffers get `torch.empty_like` storage, unchecked, and only rotary modules with `original_inv_freq` are
    recomputed."""
    mp.setattr(materialize, "_unset_buffer", lambda buffer, device: torch.empty_like(buffer, device=device))
    mp.setattr(materialize, "_still_unset", lambda buffer, fresh, version: False)

    def rotary_only(adapter, module: nn.Module) -> None:
        for sub in module.modules():
            if "RotaryEmbedding" in type(sub).__name__ and hasattr(sub, "original_inv_freq"):
                module._init_weights(sub)
    mp.setattr(Gemma3Adapter, "init_buffers", rotary_only)


def norms_ones(mp: pytest.MonkeyPatch) -> None:
    """The init rule "ones for any norm.weight" (Gemma3's norms are zero-centred: 1 + weight)."""
    family_rule = Gemma3Adapter.init_tensor

    def by_suffix(adapter, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        return torch.ones(shape) if name.endswith("norm.weight") else family_rule(adapter, name, shape, generator)
    mp.setattr(Gemma3Adapter, "init_tensor", by_suffix)


def declared_phi3_plan(mp: pytest.MonkeyPatch) -> None:
    """Phi-3 under the plan transformers declares (its fused outputs gathered), not its adapter's split by heads."""
    mp.setattr(Phi3Adapter, "tp_plan", classmethod(lambda cls, declared: declared))


VARIANTS = {"": lambda mp: None, "mutant": tp_plain_embedding, "declared": declared_phi3_plan}  # name -> patch


def conformance_worker(rank: int, world_size: int, preset: str, variant: str) -> dict:
    """On each of two processes: one preset at tp=2, under one of VARIANTS."""
    grid = ParallelGrid.build(dp=1, tp=2, pp=1, backend="gloo", timeout_s=120)
    with pytest.MonkeyPatch.context() as mp:
        VARIANTS[variant](mp)
        return sluice_run(preset, grid)


class Tp2Runs:
    """Rank 0's tp=2 run of a preset (under a variant), each a job on the session's two-process pool made the first
    time a test asks for it, so a deselected family costs nothing and a failing one fails only the tests asking."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory, self.failed = factory, {}

    def __call__(self, preset: str, variant: str = "") -> dict:
        key = f"{variant}-{preset}" if variant else preset
        if key in self.failed:  # computed once: another test of the same job reports the same error
            raise self.failed[key]
        try:
            return once_per_session(self.factory, f"conformance-tp2-{key}",
                                    lambda root: run_workers(conformance_worker, 2, preset, variant, timeout=300)[0])
        except Exception as error:
            self.failed[key] = error
            raise


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> Tp2Runs:
    return Tp2Runs(tmp_path_factory)


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def _reference(references: dict, preset: str) -> dict:
    if preset not in references:
        references[preset] = reference_run(preset)
    return references[preset]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_family_equals_its_transformers_class(preset, references):
    assert problems(sluice_run(preset, ParallelGrid.single("cpu")), _reference(references, preset)) == []


@pytest.mark.parametrize("preset", PRESETS)
def test_a_family_equals_its_transformers_class_at_tp2(preset, references, tp2):
    assert problems(tp2(preset), _reference(references, preset), tp=2) == []


@pytest.mark.parametrize("preset", PRESETS)
def test_initial_values_follow_the_family_init_weights(preset):
    assert init_problems(preset) == []


def test_tp_that_drops_the_embedding_scale_fails_the_conformance(references, tp2):
    found = problems(tp2("gemma3-tiny", "mutant"), _reference(references, "gemma3-tiny"), tp=2)
    assert any(p.startswith("logits: ") for p in found) and any(p.startswith("loss: ") for p in found), found


def test_phi3_at_tp2_gathers_no_fused_projections_output(references, tp2):
    """Split by heads, Phi-3's step (forward and backward, both pipeline chunks) runs no all-gather at all; under the
    plan transformers declares the same step gathers qkv_proj and gate_up_proj's outputs in each of its 4 layers (and
    the split inputs' gradients of o_proj and down_proj), and equals transformers too."""
    assert tp2("phi3-tiny")["gathers"] == 0
    assert tp2("phi3-tiny", "declared")["gathers"] == 4 * 2 * 2
    assert problems(tp2("phi3-tiny", "declared"), _reference(references, "phi3-tiny"), tp=2) == []


def test_unset_buffers_fail_the_conformance(references, monkeypatch):
    empty_buffers(monkeypatch)
    found = problems(sluice_run("gemma3-tiny", ParallelGrid.single("cpu")), _reference(references, "gemma3-tiny"))
    assert any(p.startswith("buffer model.embed_tokens.embed_scale: ") for p in found), found
    assert any(p.startswith("buffer model.rotary_emb.sliding_attention_inv_freq: ") for p in found), found


def test_ones_for_zero_centred_norms_fail_the_conformance(monkeypatch):
    norms_ones(monkeypatch)
    found = init_problems("gemma3-tiny")
    assert "init of model.norm.weight: [1.0, 1.0, 1.0], the class gives the constant 0.0" in found, found
    assert len(found) == 1 + 4 * 6  # the final norm, and each layer's four norms and its q/k norms


# --- the contract refuses what the mutants did silently ---------------------------------------------------------------

def test_a_buffer_the_adapter_leaves_unset_is_refused(monkeypatch):
    monkeypatch.setattr(TransformersDecoderAdapter, "init_buffers", lambda adapter, module: None)
    decoder = decoder_of(build_model(family_config("llama-tiny")))
    with pytest.raises(ContractError) as error:
        materialize_(decoder, seeded_init(decoder, SEED), 0, 1, torch.device("cpu"))
    assert str(error.value) == ("model.rotary_emb.inv_freq: a buffer that TransformersDecoderAdapter.init_buffers "
                                "leaves unset after materialising from the meta device; compute it there (as the "
                                "family's _init_weights does)")


def test_a_meta_buffer_reads_nan_until_the_adapter_sets_it(monkeypatch):
    seen = {}
    monkeypatch.setattr(TransformersDecoderAdapter, "init_buffers",
                        lambda adapter, module: seen.update(module.model.rotary_emb.named_buffers()))
    decoder = decoder_of(build_model(family_config("qwen3-tiny")))
    with pytest.raises(ContractError):
        materialize_(decoder, seeded_init(decoder, SEED), 0, 1, torch.device("cpu"))
    assert seen.keys() == {"inv_freq", "original_inv_freq"} and all(b.isnan().all() for b in seen.values())


def test_the_tp_pass_refuses_a_subclass_the_adapter_does_not_keep(monkeypatch):
    monkeypatch.setattr(Gemma3Adapter, "tp_module", lambda adapter, dense, parallel: None)
    decoder = decoder_of(build_model(family_config("gemma3-tiny")))
    with pytest.raises(ContractError) as error:
        shard_modules(decoder, ParallelGrid(tp=2))
    assert str(error.value) == ("model.embed_tokens is a Gemma3TextScaledWordEmbedding, a subclass of nn.Embedding "
                                "that VocabParallelEmbedding would replace by the base class's forward; "
                                "Gemma3Adapter.tp_module must return a TP module keeping its behaviour")


def test_a_parameter_the_family_init_leaves_unset_is_refused(monkeypatch):
    decoder = decoder_of(build_model(family_config("mistral-tiny")))
    monkeypatch.setattr(type(decoder.module), "_init_weights", lambda model, module: None)
    with pytest.raises(ContractError) as error:
        seeded_init(decoder, SEED)("model.layers.0.mlp.up_proj.weight", (192, 64))
    assert str(error.value) == ("model.layers.0.mlp.up_proj.weight: Linear is not initialised by its model's "
                                "_init_weights; give the family's adapter an init_tensor rule for it")


def test_registering_a_family_checks_its_adapter_and_presets():
    with pytest.raises(RegistryError) as error:
        registry(Family("phi3", "Phi-3", TransformersDecoderAdapter, ("llama-tiny",)))
    assert str(error.value) == "family 'phi3': preset 'llama-tiny' builds 'llama'"
    with pytest.raises(RegistryError) as error:
        registry(Family("phi3", "Phi-3", object, ()))
    assert str(error.value).startswith("family 'phi3': object lacks the FamilyAdapter hooks embed, layer_inputs, ")


def test_a_family_declaring_a_style_the_table_lacks_is_refused_when_it_registers(monkeypatch):
    """What `models.registry` runs at import, on a fixture Llama whose declared plans (or adapter) name an unknown
    TP style: one line naming family, module and style, before any model is built."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def refusal(adapter=TransformersDecoderAdapter) -> str:
        with pytest.raises(RegistryError) as error:
            registry(Family("llama", "Llama", adapter, ("llama-tiny",)))
        return str(error.value)

    tail = ", which Sluice's TP style table lacks; add its builder to parallel/tensor_styles.py STYLES or choose a " \
           "known style in the adapter's tp_plan"
    with monkeypatch.context() as patch:
        patch.setattr(LlamaConfig, "base_model_tp_plan",
                      {**LlamaConfig.base_model_tp_plan, "layers.*.mlp.gate_proj": "colwise_strided"})
        assert refusal() == ("family 'llama': layers.*.mlp.gate_proj declares TP style 'colwise_strided' "
                             f"(base_model_tp_plan){tail}")
    with monkeypatch.context() as patch:
        patch.setattr(LlamaForCausalLM, "_tp_plan", {"lm_head": "vocab_gather"})
        assert refusal() == f"family 'llama': lm_head declares TP style 'vocab_gather' (_tp_plan){tail}"

    class OddPlan(TransformersDecoderAdapter):
        @classmethod
        def tp_plan(cls, declared: dict[str, str]) -> dict[str, str]:
            return {**declared, "layers.*.self_attn.o_proj": "rowwise_strided"}

    assert refusal(OddPlan) == ("family 'llama': layers.*.self_attn.o_proj declares TP style 'rowwise_strided' "
                                f"(OddPlan.tp_plan){tail}")
    assert list(registry(Family("llama", "Llama", TransformersDecoderAdapter, ("llama-tiny",)))) == ["llama"]


def test_the_docs_list_every_registered_family():
    root = Path(__file__).resolve().parent.parent
    for page in ("README.md", "docs/concepts.md"):
        text = (root / page).read_text()
        missing = [f"{family.name} ({', '.join(family.presets)})" for family in FAMILIES.values()
                   if not all(f"`{preset}`" in text for preset in family.presets) or family.name not in text]
        assert not missing, f"{page} does not list {missing}"
