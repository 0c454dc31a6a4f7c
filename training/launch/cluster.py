"""Where a self-launch puts its workers: all on this machine, or this node's share of a multi-node Slurm job."""

import uuid
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLaunch:
    """One node's part of a launch: how many nodes rendezvous where, and how many workers start here."""

    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    run_id: str


def node_launch(world_size: int, env: Mapping[str, str]) -> NodeLaunch:
    """All workers here; inside a multi-node submitit Slurm job (one task per node), this node's share."""
    nnodes = int(env.get("SLURM_JOB_NUM_NODES", "1")) if env.get("SUBMITIT_EXECUTOR") == "slurm" else 1
    if nnodes == 1:
        return NodeLaunch(1, world_size, "127.0.0.1:0", str(uuid.uuid4()))
    if world_size % nnodes:
        raise ValueError(f"parallel.dp*tp*pp = {world_size} workers do not split evenly over {nnodes} nodes; "
                         f"set parallel.dp so that the product is a multiple of hydra.launcher.nodes={nnodes}")
    from submitit.slurm.slurm import SlurmJobEnvironment  # parses SLURM_JOB_NODELIST's bracket syntax

    job = SlurmJobEnvironment()
    port = 20000 + int(job.raw_job_id) % 20000  # per job: two jobs sharing a node do not collide
    return NodeLaunch(nnodes, world_size // nnodes, f"{job.hostnames[0]}:{port}", f"sluice-{job.job_id}")


def is_launch_leader(env: Mapping[str, str]) -> bool:
    """True for the process that speaks for the run before workers start: global rank 0, or the first
    node's task of a Slurm job (other nodes must not refuse a run directory that node 0 just created)."""
    return int(env.get("RANK", env.get("SLURM_PROCID", "0"))) == 0
