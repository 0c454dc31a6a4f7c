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
