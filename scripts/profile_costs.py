"""Measure (or read from the cache) the costs the layout search predicts with, for a run config; print them.

    python scripts/profile_costs.py model.hidden_size=256 train.seq_len=128 [--refresh] [--world-size=2]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import DictConfig  # noqa: E402

from training.launch.cli import compose_validated  # noqa: E402
from training.layout_search.costs import RECOMPUTE_MODES, MeasuredCosts, cache_path  # noqa: E402
from training.layout_search.profile import measured_costs  # noqa: E402


def table(costs: MeasuredCosts) -> str:
    """The measured figures, one per line, in ms and MiB."""
    ms, mib = 1e3, 1 / (1 << 20)
    modes = [mode for mode in RECOMPUTE_MODES if mode in costs.layer_b]
    lines = [f"key: {costs.key}",
             f"{'piece':<28}{'F ms':>9}{'B ms':>9}{'I ms':>9}{'W ms':>9}{'saved MiB':>11}{'params':>11}"]
    for mode in modes:
        f = f"{costs.layer_f * ms:9.2f}" if mode == "none" else f"{'':>9}"
        w = f"{costs.layer_w * ms:9.2f}" if mode == "none" else f"{'':>9}"
        lines.append(f"{'layer (recompute ' + mode + ')':<28}{f}{costs.layer_b[mode] * ms:9.2f}"
                     f"{costs.layer_i[mode] * ms:9.2f}{w}{costs.layer_saved[mode] * mib:11.2f}{costs.layer_params:11,}")
    for name in ("embed", "head"):
        lines.append(f"{name:<28}{getattr(costs, name + '_f') * ms:9.2f}{getattr(costs, name + '_b') * ms:9.2f}"
                     f"{'':>18}{getattr(costs, name + '_saved') * mib:11.2f}{getattr(costs, name + '_params'):11,}")
    lines += [f"layer bytes held between I and W: {costs.layer_deferred * mib:.2f} MiB; boundary tensor "
              f"{costs.boundary_bytes * mib:.2f} MiB; {costs.param_bytes} bytes per parameter",
              f"gradient clipping + AdamW step: {costs.optimizer_s_per_param * 1e9:.2f} ns per parameter",
              f"P2P: {costs.p2p.latency_s * 1e6:.0f} us + {costs.p2p.per_byte_s * 1e9:.3f} ns/byte; "
              "all-reduce (2 ranks): "
              f"{costs.allreduce.latency_s * 1e6:.0f} us + {costs.allreduce.per_byte_s * 1e9:.3f} ns/byte"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Compose the config as train.py would, measure or load its costs, print the table and the cache path."""
    refresh = "--refresh" in argv
    world = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--world-size=")), None)
    cfg: DictConfig = compose_validated([a for a in argv if not a.startswith("--")])
    costs = measured_costs(cfg, world_size=world, refresh=refresh)
    print(table(costs))
    print(f"cache: {cache_path(cfg, costs.key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
