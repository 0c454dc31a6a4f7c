"""The run-config rules of sharded data parallelism (`parallel.zero`, `parallel.dp_replicate`), one line each."""

from omegaconf import DictConfig


def zero_problem(cfg: DictConfig, dp: int) -> str | None:
    """Why `parallel.zero` / `parallel.dp_replicate` cannot run at the data-parallel size `dp`, or None."""
    p = cfg.parallel
    zero, replicate, ep = p.zero, p.dp_replicate, p.ep
    if replicate > 1 and zero < 2:
        return (f"parallel.dp_replicate={replicate} replicates FSDP's shards (HSDP) and is read only with "
                f"parallel.zero=2 or 3 (here {zero}); set parallel.zero=3 or parallel.dp_replicate=1")
    if zero < 2:
        return None
    if dp == 1:
        return (f"parallel.zero={zero} shards over the data-parallel ranks and this layout has one (dp=1): nothing "
                "to shard; use parallel.zero=0, or parallel.dp>=2 (with that many more workers)")
    if dp % replicate:
        choices = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        return (f"parallel.dp_replicate={replicate} does not divide the data-parallel size {dp}; choose one of "
                f"{{{choices}}}")
    if replicate == dp:
        return (f"parallel.dp_replicate={replicate} leaves one rank per shard group (dp={dp}): nothing to shard; "
                f"use a dp_replicate below {dp}, or parallel.zero=0 (plain data parallelism)")
    if ep > 1 and replicate > 1:
        return (f"parallel.dp_replicate={replicate} with parallel.ep={ep}: under EP the dense weights already "
                "replicate over the ep group and shard over the ranks holding the same experts; set "
                "parallel.dp_replicate=1")
    return None
