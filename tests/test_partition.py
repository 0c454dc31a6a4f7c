"""Layer partition and stage placement: the formula, explicit lists, and one clear error per mistake."""

import pytest

from parallel.pipeline.partition import PartitionError, layer_partition, rank_stages, stage_to_rank


def test_balanced_formula():
    assert layer_partition(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert layer_partition(5, 2) == [range(0, 2), range(2, 5)]  # N*s//S: the remainder goes to later stages
    assert layer_partition(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert layer_partition(4, 1) == [range(0, 4)]
    for n in range(1, 20):
        for s in range(1, n + 1):
            parts = layer_partition(n, s)
            assert [x for p in parts for x in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced to one layer


def test_explicit_list_overrides_the_formula():
    assert layer_partition(8, 3, [3, 3, 2]) == [range(0, 3), range(3, 6), range(6, 8)]
    assert layer_partition(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize(
    "args,message",
    [
        ((4, 5), "parallel.pp*parallel.vpp = 5 stages but the model has 4 layers; use at most 4 stages"),
        ((4, 0), "parallel.pp*parallel.vpp = 0 stages; need at least 1"),
        ((8, 3, [3, 3]), "parallel.layers_per_stage has 2 entries but there are 3 stages"),
        ((8, 3, [4, 4, 0]), "parallel.layers_per_stage[2] = 0; every stage needs at least one layer"),
        ((8, 3, [5, -1, 4]), "parallel.layers_per_stage[1] = -1; every stage needs at least one layer"),
        ((8, 3, [3, 3, 3]), "parallel.layers_per_stage = [3, 3, 3] sums to 9 but the model has 8 layers"),
        ((8, 2, [4.0, 4]), "parallel.layers_per_stage[0] = 4.0 is not an integer"),
    ],
)
def test_errors_say_what_is_wrong_and_how_to_fix_it(args, message):
    with pytest.raises(PartitionError) as err:
        layer_partition(*args)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_loop_placement():
    assert [stage_to_rank(s, 4, "loop") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rank_stages(1, 4, 2, "loop") == [1, 5]
    assert rank_stages(0, 2, 1, "loop") == [0]


def test_v_placement():
    assert [stage_to_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages(0, 4, 2, "v") == [0, 7]
    assert rank_stages(3, 4, 2, "v") == [3, 4]
    with pytest.raises(PartitionError, match="set parallel.vpp=2"):
        rank_stages(0, 4, 3, "v")
    with pytest.raises(PartitionError, match="does not exist"):
        stage_to_rank(8, 4, "v")
    with pytest.raises(PartitionError, match="unknown stage placement 'zigzag'"):
        stage_to_rank(0, 4, "zigzag")
