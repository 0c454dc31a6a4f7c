"""`parallel.layers_per_stage=auto`: split the layers so that stage costs (embedding on the first stage, head
and loss on the last) are as even as possible, from measured costs where cached, else from FLOPs."""

import logging

from omegaconf import DictConfig

from parallel.pipeline.partition import balanced_partition
from training.layout_search.costs import MeasuredCosts
from training.config.schema import model_config, model_decoder

log = logging.getLogger("sluice")
AUTO = "auto"


def cost_balanced_partition(num_layers: int, n_stages: int, embed: float, head: float) -> tuple[int, ...]:
    """Layer counts per stage for costs in units of one decoder layer (the embedding's, the head's)."""
    return tuple(balanced_partition(num_layers, n_stages, 1.0, embed, head))


def measured_weights(costs: MeasuredCosts, recompute: str) -> tuple[float, float]:
    """The embedding's and the head's forward + backward, in units of one layer's (its recomputation included)."""
    layer = costs.layer_f + costs.layer_b[recompute]
    return (costs.embed_f + costs.embed_b) / layer, (costs.head_f + costs.head_b) / layer


def flop_weights(cfg: DictConfig) -> tuple[float, float]:
    """The same from FLOPs (training/report/flops.py's count): the embedding is a lookup, the head a vocab-wide matmul."""
    decoder = model_decoder(cfg)
    c = decoder.config
    head = c.hidden_size * c.vocab_size
    per_layer = (decoder.adapter.matmul_params_per_token() - head) / c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layer = 6 * per_layer + 12 * c.num_attention_heads * head_dim * cfg.train.seq_len
    layer *= {"full": 8 / 6, "selective": 1.0}.get(cfg.train.recompute, 1.0)  # full: one more forward
    return 0.0, 6 * head / layer


def stage_weights(cfg: DictConfig) -> tuple[float, float, str]:
    """(embed, head) in layer units and where they come from: the cached measurement, else FLOPs."""
    from training.layout_search.profile import measured_costs  # torch-heavy: only when a partition is wanted

    costs = measured_costs(cfg, cached_only=True)
    if costs is not None:
        return (*measured_weights(costs, cfg.train.recompute), "measured")
    return (*flop_weights(cfg), "FLOP estimate")


def resolve_auto_partition(cfg: DictConfig) -> str | None:
    """Replace parallel.layers_per_stage=auto by the cost-balanced split; return the line saying what it chose."""
    p = cfg.parallel
    if p.layers_per_stage != AUTO:
        return None
    n_stages, layers = p.pp * p.vpp, model_config(cfg).num_hidden_layers
    embed, head, source = stage_weights(cfg)
    counts = cost_balanced_partition(layers, n_stages, embed, head) if n_stages <= layers else None
    if counts is None:
        p.layers_per_stage = None  # the partition check names the problem
        return None
    p.layers_per_stage = list(counts)
    costs = [n + embed * (s == 0) + head * (s == n_stages - 1) for s, n in enumerate(counts)]
    line = (f"layers_per_stage=auto chose {list(counts)} (stage costs {', '.join(f'{c:.2f}' for c in costs)} "
            f"layer units, {source})")
    log.info(line)
    return line
