"""TP at tp=2 computes the single-process numbers: loss, gradients (gathered over shards) and names."""

import pytest
import torch
import torch.nn.functional as F

from minimind.config import MiniMindConfig
from minimind.model import MiniMindForCausalLM
from models import build_model, decoder_of
from parallel.collectives import all_gather_cat
from parallel.grid import ParallelGrid
from parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                             vocab_parallel_cross_entropy)
from parallel.tensor_pass import apply_tensor_parallel, check_tp_divisibility
from spawn import run_workers
from tests.tp_style_cases import style_errors

TP = 2


def tiny_config(use_moe: bool) -> MiniMindConfig:
    # Top-2 routing: with top-1 and norm_topk_prob the routing weight is w/w = 1, so the router's CE
    # gradient is pure rounding noise and no layout could match it to 1e-5.
    return MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=256, intermediate_size=128, max_position_embeddings=64, use_moe=use_moe,
                          num_experts_per_tok=2)


def tiny_model(use_moe: bool) -> MiniMindForCausalLM:
    torch.manual_seed(0)
    return MiniMindForCausalLM(tiny_config(use_moe))


def tp_sizes(config: MiniMindConfig) -> dict[str, int]:
    """The config sizes TP splits, as the family adapter names them (by config key)."""
    return decoder_of(build_model(config, device="meta")).adapter.tp_sizes()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids [2, 16] and next-token targets, some ignored."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 17), generator=g)
    targets = ids[:, 1:].clone()
    targets[0, :3] = -100
    return ids[:, :-1], targets


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rel: float, name: str) -> None:
    """max |actual - expected| <= rel * max |expected|: elementwise rel fails on grads that are ~0."""
    err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert actual.shape == expected.shape and err <= rel * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def loss_of(model: MiniMindForCausalLM, grid: ParallelGrid) -> torch.Tensor:
    """Token-sum CE over (possibly vocab-sharded) logits plus the MoE aux loss."""
    ids, targets = batch()
    out = model(input_ids=ids)
    width = out.logits.shape[-1]
    ce = vocab_parallel_cross_entropy(out.logits.flatten(0, 1), targets.flatten(), grid.tp_group, grid.tp_rank * width)
    return ce.sum() + out.aux_loss


def _tp_worker(rank: int, world_size: int, use_moe: bool) -> dict:
    grid = ParallelGrid.build(dp=1, tp=TP, pp=1, backend="gloo", timeout_s=60)
    model = apply_tensor_parallel(decoder_of(tiny_model(use_moe)), grid).module
    loss = loss_of(model, grid)
    loss.backward()
    ids, _ = batch()
    with torch.no_grad():
        full_logits = all_gather_cat(model(input_ids=ids).logits, grid.tp_group, dim=-1)
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "partition_dim": {n: getattr(p, "partition_dim", None) for n, p in model.named_parameters()
                          if getattr(p, "tensor_parallel", False)},
        "keys": list(model.state_dict()),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "types": {n: type(m).__name__ for n, m in model.named_modules()},
        "logits": full_logits,
        **_pruned_last_stage(grid, use_moe),
        "styles": style_errors(grid) if not use_moe else {},  # every style of the table, in this spawn
    }


def _pruned_last_stage(grid: ParallelGrid, use_moe: bool) -> dict:
    """A pipeline-pruned copy (no embedding, no layer 0) still shards: names kept, lm_head its own slice."""
    decoder = decoder_of(tiny_model(use_moe))
    dense_head = decoder.module.lm_head.weight.detach().clone()
    model = apply_tensor_parallel(decoder.prune(range(1, 2), False, True), grid).module
    width = dense_head.shape[0] // grid.tp
    return {"pruned_keys": list(model.state_dict()),
            "pruned_head_ok": torch.equal(model.lm_head.weight, dense_head[grid.tp_rank * width:][:width])}


@pytest.mark.parametrize("use_moe", [False, True], ids=["dense", "moe"])
def test_tp2_matches_single_process(use_moe: bool):
    results = run_workers(_tp_worker, TP, use_moe, timeout=120)
    dense = tiny_model(use_moe)
    loss = loss_of(dense, ParallelGrid.single("cpu"))
    loss.backward()
    ids, _ = batch()
    with torch.no_grad():
        dense_logits = dense(input_ids=ids).logits

    for r in results:
        torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-5, atol=0)
        assert_close_scaled(r["logits"], dense_logits, 1e-5, "logits")
        assert r["keys"] == list(dense.state_dict()) and r["tied"]
        assert r["pruned_keys"] == [k for k in dense.state_dict() if not k.startswith(("model.embed", "model.layers.0."))]
        assert r["pruned_head_ok"]
    types = results[0]["types"]
    assert types["model.embed_tokens"] == VocabParallelEmbedding.__name__
    assert types["lm_head"] == types["model.layers.1.self_attn.k_proj"] == ColumnParallelLinear.__name__
    assert types["model.layers.0.self_attn.o_proj"] == RowParallelLinear.__name__
    if use_moe:
        assert types["model.layers.0.mlp.experts.3.down_proj"] == RowParallelLinear.__name__
        assert types["model.layers.0.mlp.gate"] == "Linear"  # the router stays replicated

    dims = results[0]["partition_dim"]
    for name, param in dense.named_parameters():
        grads = [r["grads"][name] for r in results]
        if name in dims:
            grad = torch.cat(grads, dim=dims[name])
        else:  # replicated: every rank holds the full gradient (q/k norms via their grad all-reduce)
            grad = grads[0]
            for other in grads[1:]:
                torch.testing.assert_close(other, grad, rtol=0, atol=0, msg=f"{name} differs across TP ranks")
        assert_close_scaled(grad, param.grad, 1e-5, f"grad of {name}")
    from tests.tp_style_cases import STYLE_CASES

    assert results[0]["styles"].keys() == (STYLE_CASES.keys() if not use_moe else set())
    for style, error in results[0]["styles"].items():
        assert error <= 1e-5, f"TP style {style}: relative error {error:.3g} against the whole module"
    expected_sharded = {n for n in types if n.endswith(("_proj", "embed_tokens"))}
    assert {n.rsplit(".", 1)[0] for n in dims} == expected_sharded - {"lm_head"}  # lm_head.weight is the tie


def _ce_worker(rank: int, world_size: int) -> dict:
    grid = ParallelGrid.build(dp=1, tp=world_size, pp=1, backend="gloo", timeout_s=60)
    logits, targets = ce_inputs()
    width = logits.shape[-1] // world_size
    shard = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets, grid.tp_group, rank * width)
    (loss * torch.arange(1.0, len(targets) + 1)).sum().backward()  # non-uniform upstream grads
    return {"loss": loss.detach(), "grad": shard.grad}


def ce_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 256, generator=g) * 3
    targets = torch.randint(0, 256, (12,), generator=g)
    targets[[1, 7]] = -100
    targets[2], targets[3] = 0, 255  # both ends of the vocab
    return logits, targets


def test_vocab_parallel_cross_entropy_tp2():
    results = run_workers(_ce_worker, TP, timeout=120)
    logits, targets = ce_inputs()
    logits.requires_grad_()
    expected = F.cross_entropy(logits, targets, reduction="none")
    (expected * torch.arange(1.0, len(targets) + 1)).sum().backward()
    for r in results:
        torch.testing.assert_close(r["loss"], expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results], dim=-1), logits.grad, rtol=1e-6, atol=1e-7)
    assert results[0]["loss"][1] == 0 and results[0]["loss"][7] == 0


def test_vocab_parallel_cross_entropy_without_group_is_cross_entropy():
    logits, targets = ce_inputs()
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, targets, None, 0),
                               F.cross_entropy(logits, targets, reduction="none"), rtol=0, atol=0)


def test_divisibility_error():
    with pytest.raises(ValueError, match=r"^parallel.tp=3 does not divide num_attention_heads=4; choose tp in \{1, 2\}$"):
        apply_tensor_parallel(decoder_of(tiny_model(False)), ParallelGrid(tp=3))
    config = tiny_config(False)
    config.num_attention_heads, config.num_key_value_heads = 6, 2
    with pytest.raises(ValueError, match=r"^parallel.tp=3 does not divide num_key_value_heads=2; choose tp in \{1, 2\}$"):
        check_tp_divisibility(tp_sizes(config), 3)
    config = tiny_config(True)
    config.moe_intermediate_size = 97
    with pytest.raises(ValueError, match=r"^parallel.tp=2 does not divide moe_intermediate_size=97; choose tp in \{1\}$"):
        check_tp_divisibility(tp_sizes(config), 2)
    check_tp_divisibility(tp_sizes(tiny_config(True)), 2)


def test_tp1_is_identity():
    decoder = decoder_of(tiny_model(True))
    assert apply_tensor_parallel(decoder, ParallelGrid.single("cpu")) is decoder
    assert type(decoder.module.lm_head).__name__ == "Linear"


def test_the_style_table_covers_every_style_the_installed_transformers_declares():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from parallel.tensor_styles import STYLES
    from tests.tp_style_cases import STYLE_CASES

    # The styles transformers' TP module registers (its expert-parallel module adds EP plans' styles to the same
    # registry: `parallel.expert` handles those).
    declared = {name for name in ALL_PARALLEL_STYLES.keys()
                if type(ALL_PARALLEL_STYLES[name]).__module__ == "transformers.distributed.tensor_parallel"}
    assert declared and declared <= set(STYLES), f"styles without a builder: {sorted(declared - set(STYLES))}"
    tested = {style for styles in STYLE_CASES.values() for style in styles}
    assert set(STYLES) <= tested, f"styles no tp2 case runs: {sorted(set(STYLES) - tested)}"


def test_a_tied_pair_planned_to_shard_alike_shares_one_shard_and_otherwise_is_refused():
    """A tie partner reuses the shard its pair made along the same dim; along another dim (or packed, or by input
    columns) it is one line naming family, module and style, never a silent second shard."""
    from types import SimpleNamespace

    from torch import nn

    from parallel.decoder import ContractError
    from parallel.tensor_styles import STYLES, Site

    grid, config = SimpleNamespace(tp_rank=0, tp=2, tp_group=None), SimpleNamespace(model_type="toy")
    for embedding_style, head_style, shared in (("embedding_rowwise", "colwise", True),
                                                ("embedding_colwise", "colwise", False),
                                                ("embedding_rowwise", "rowwise", False)):
        embed, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        head.weight = embed.weight
        ties: dict = {}
        built = STYLES[embedding_style](Site("embed", embed, embedding_style, grid, None, config, ties))
        ties[id(embed.weight)] = (built.weight.partition_dim, built.weight)  # what the TP pass records
        site = Site("lm_head", head, head_style, grid, None, config, ties)
        if shared:
            assert STYLES[head_style](site).weight is built.weight
            continue
        with pytest.raises(ContractError, match=rf"^family 'toy': lm_head declares TP style '{head_style}', which "):
            STYLES[head_style](site)
