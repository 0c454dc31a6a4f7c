"""The compile pass: each decoder layer of a built chunk compiled by torch.compile (inductor), in place.

It runs last, after the TP, EP and recompute passes, so what gets compiled is the layer those passes made (its TP
collectives, its expert dispatch, its checkpointed forward); whatever dynamo cannot trace (a collective with host
split sizes, the I/W split's deferral) stays eager behind a graph break. `nn.Module.compile` compiles the module's
call in place: the layer keeps its class, its parameters and their dense names, so checkpoints, gradient sync and
the optimizer see the same model. The layers of a model share one code path, so a chunk compiles it once (per
distinct shape), at its first forward.
"""

from __future__ import annotations

from parallel.decoder import Decoder


def apply_compile(decoder: Decoder, enabled: bool) -> Decoder:
    """Compile every decoder layer of `decoder` in place when `enabled`."""
    if enabled:
        for _, layer in decoder.blocks():
            layer.compile()
    return decoder
