"""The sharded data-parallel layouts (parallel.zero=2/3, FSDP2) of the equivalence suite, and the check that they
really shard: they ride tests/test_equivalence.py's spawns (the emulated ones share its world-2 and world-4 groups)."""

from tests.equivalence import BF16_SPREAD, EMU, Layout, assert_equivalent, bf16_tolerances, distance

TINY, MOE = ["model=tiny"], ["model=tiny-moe"]
ZERO3 = "parallel.zero=3"
GATHER_BF16 = "parallel.mixed_precision_param=bf16"  # FSDP2's MixedPrecisionPolicy: bf16 gathers and compute

FSDP_LAYOUTS = [Layout(*case) for case in [
    ("zero3-dp2-emu", TINY, ["parallel.dp=2", ZERO3, EMU], 2, 2),
    ("zero2-dp2-emu", TINY, ["parallel.dp=2", "parallel.zero=2", EMU], 2, 2),
    ("zero3-dp2-pp2-1f1b-emu", TINY, ["parallel.dp=2", "parallel.pp=2", "schedule=1f1b", ZERO3, EMU], 2, 2),
    # bf16 gathers against fp32 one process (`assert_bf16_gathers`); across two stages the tied pair stays whole (fp32)
    ("zero3-bf16-dp2-pp2-1f1b-emu", TINY, ["parallel.dp=2", "parallel.pp=2", "schedule=1f1b", ZERO3, GATHER_BF16, EMU],
     2, 2),
    ("zero3-dp2-pp2-zbv-emu", TINY, ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv", ZERO3, EMU],
     2, 2),
    ("zero3-moe-dp2-ep2-emu", MOE, ["parallel.dp=2", "parallel.ep=2", ZERO3, EMU], 2, 2),
    ("zero3-lora-dp2-emu", ["model=tiny", "lora.rank=4"], ["parallel.dp=2", ZERO3, EMU], 2, 2),
    ("zero3-dp2-tp2-emu", TINY, ["parallel.dp=2", "parallel.tp=2", ZERO3, EMU], 4, 2),
    ("zero3-dp2-tp2-pp2-emu", TINY, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", ZERO3, EMU], 4, 2),
    ("zero3-moe-dp4-ep2-emu", MOE, ["parallel.dp=4", "parallel.ep=2", ZERO3, EMU], 4, 4),
    ("zero3-dp4-hsdp2-emu", TINY, ["parallel.dp=4", "parallel.dp_replicate=2", ZERO3, EMU], 4, 4),
    # Real P2P between the pipeline ranks: FSDP's gathers and reduce-scatters beside the transfers.
    ("zero3-dp2-pp2-1f1b", TINY, ["parallel.dp=2", "parallel.pp=2", "schedule=1f1b", ZERO3], 4, 2),
]]


def shard_degree(case: Layout) -> int:
    """Ranks each sharded tensor is split over: dp / dp_replicate (under EP: dp / ep for the dense ones)."""
    value = {a.split("=")[0]: int(a.split("=")[1]) for a in case.layout if a.split("=")[1].isdigit()}
    dp, ep = value.get("parallel.dp", 1), value.get("parallel.ep", 1)
    return dp // max(value.get("parallel.dp_replicate", 1), ep if dp > ep else 1)


def assert_sharded(results: list[dict], case: Layout) -> None:
    """Every decoder layer's linear weight (not an expert's) is an FSDP shard on every rank, and the DP ranks of a
    (pp, tp) coordinate hold each one `dp / degree` times over (once per replica) between them. (Under TP the q/k norms
    stay whole: their gradient hook sums over TP.)"""
    degree, dp = shard_degree(case), case.dp
    held: dict[tuple, int] = {}  # (pp, tp, name) -> elements held by the coordinate's DP ranks
    for result in results:
        layers = {n: numel for n, numel in result["whole_numel"].items() if ".layers." in n and "_proj." in n
                  and "experts" not in n}
        assert layers, "no decoder layer weight on this rank"
        unsharded = sorted(n for n in layers if n not in result["sharded"])
        assert not unsharded, f"{case.name}: kept whole on rank {result['coords']}: {unsharded[:3]}"
        pp, _, tp = result["coords"]
        for name in layers:
            held[(pp, tp, name)] = held.get((pp, tp, name), 0) + result["sharded"][name]
    for (pp, tp, name), total in held.items():
        whole = next(r["whole_numel"][name] for r in results if r["coords"][0] == pp and r["coords"][2] == tp)
        assert total == whole * dp // degree, (case.name, name, total, whole, dp, degree)


def assert_bf16_gathers(results: list[dict], fp32: dict, bf16: dict) -> None:
    """A layout with bf16 gathers against the fp32 one-process run `fp32`: within twice `bf16_tolerances` (6x, per
    quantity, the distance d of the bf16-autocast one-process run `bf16` from `fp32`), and at least d / 10 from `fp32`
    as one norm: it computed bf16 numbers (with fp32 gathers this layout sits 3e-8 from `fp32`: the order of sums).

    Why twice. bf16 gathers round what autocast rounds (every weight, and the activations entering a matmul), and
    more: FSDP casts each layer's input, the residual stream, to bf16 where autocast keeps it fp32, and the norms'
    weights and the layers' elementwise work run in bf16 too. About twice the roundings, so a distance up to about
    2d from the exact numbers; the spread of 3 between two roundings stays. Measured (dp2-pp2 zero3, 3 steps): loss
    2.4d, gradients 1.5d, grad norm 1.1d, parameters 1.2d, against 6d; as one norm 1.26d from `fp32`. The bugs this
    exists to catch are far outside: gradients reduced as a mean over dp2 are 0.5 off (6d is 0.068 here)."""
    assert_equivalent(results, fp32, bf16_tolerances(bf16, fp32, spread=2 * BF16_SPREAD))
    d = distance([bf16], fp32)
    assert distance(results, fp32) > d / 10, (distance(results, fp32), d)
