"""Which layers each pipeline stage owns, and which rank runs each stage."""

from __future__ import annotations

PLACEMENTS = ("loop", "v")


class PartitionError(ValueError):
    """A partition or placement that cannot work; the message says what to change."""


def layer_partition(num_layers: int, num_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Layer ranges per stage: balanced `N*s//S .. N*(s+1)//S`, or the explicit `layers_per_stage`."""
    if num_stages < 1:
        raise PartitionError(f"parallel.pp*parallel.vpp = {num_stages} stages; need at least 1")
    if num_stages > num_layers:
        raise PartitionError(
            f"parallel.pp*parallel.vpp = {num_stages} stages but the model has {num_layers} layers; "
            f"use at most {num_layers} stages"
        )
    if layers_per_stage is None:
        # Balanced to one layer; a remainder goes to the later stages. Every rank evaluates the same
        # formula, so no rank needs to be told another rank's share.
        bounds = [num_layers * s // num_stages for s in range(num_stages + 1)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise PartitionError(
                f"parallel.layers_per_stage has {len(counts)} entries but there are {num_stages} stages "
                f"(parallel.pp*parallel.vpp); give one layer count per stage"
            )
        for s, n in enumerate(counts):
            if isinstance(n, bool) or not isinstance(n, int):
                raise PartitionError(f"parallel.layers_per_stage[{s}] = {n!r} is not an integer layer count")
            if n < 1:
                raise PartitionError(
                    f"parallel.layers_per_stage[{s}] = {n}; every stage needs at least one layer"
                )
        if sum(counts) != num_layers:
            raise PartitionError(
                f"parallel.layers_per_stage = {counts} sums to {sum(counts)} but the model has "
                f"{num_layers} layers; make the entries add up to {num_layers}"
            )
        bounds = [sum(counts[:s]) for s in range(num_stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def balanced_partition(num_layers: int, num_stages: int, layer: float, first: float = 0.0,
                       last: float = 0.0) -> list[int]:
    """Layer counts per stage minimising the costliest stage: `layer` per layer, plus `first` on stage 0 and
    `last` on the last stage (the embedding; the head and its loss). Ties keep the counts as even as possible."""
    if not 1 <= num_stages <= num_layers:
        raise PartitionError(f"cannot split {num_layers} layers into {num_stages} stages of at least one layer")
    extra = [0.0] * num_stages
    extra[0] += first
    extra[-1] += last

    def capacities(limit: float) -> list[int]:
        return [max(1, min(num_layers, int((limit - e) / layer + 1e-9))) if layer > 0 else num_layers
                for e in extra]

    # The optimum is one stage's cost exactly: try each candidate bound, smallest first.
    bounds = sorted({k * layer + e for e in extra for k in range(1, num_layers + 1)})
    limit = next(b for b in bounds if sum(capacities(b)) >= num_layers)
    counts = capacities(limit)
    while sum(counts) > num_layers:  # give back from the fullest stage (the cheapest one on a tie)
        s = max((s for s in range(num_stages) if counts[s] > 1), key=lambda s: (counts[s], -extra[s], s))
        counts[s] -= 1
    return counts


def stage_to_rank(stage: int, pp: int, placement: str) -> int:
    """Pipeline rank running `stage`: `loop` puts s on s % pp; `v` puts s and 2pp-1-s on the same rank."""
    if placement == "loop":
        return stage % pp
    if placement == "v":
        if not 0 <= stage < 2 * pp:
            raise PartitionError(f"stage {stage} does not exist under the V placement with parallel.pp={pp}")
        return stage if stage < pp else 2 * pp - 1 - stage
    raise PartitionError(f"unknown stage placement {placement!r}; use one of {PLACEMENTS}")


def rank_stages(rank: int, pp: int, vpp: int, placement: str) -> list[int]:
    """Stages held by pipeline `rank`, in increasing order (its model chunks)."""
    if placement == "loop":
        return [rank + k * pp for k in range(vpp)]
    if placement == "v":
        if vpp != 2:
            raise PartitionError(f"the V placement holds two chunks per rank; set parallel.vpp=2 (got {vpp})")
        return [rank, 2 * pp - 1 - rank]
    raise PartitionError(f"unknown stage placement {placement!r}; use one of {PLACEMENTS}")


# --- Building a stage module by pruning the dense model (names kept) belongs below. ---
