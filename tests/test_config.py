import pytest

from flatep import EPConfig, MODEL_SHAPES, preset
from flatep.config import align_up


def test_derived_sizes():
    config = EPConfig(ranks=8, experts=384, top_k=8, hidden=7168, intermediate=2048, capacity=8192)
    assert config.experts_per_rank == 48
    assert config.groups == 96
    assert config.shard_rows() == align_up(8192 * 8 + 127 * 96, 128)
    assert config.shard_rows("none") == align_up(8 * 8192 * 8 + 127 * 48, 128)
    assert config.step_rows(8 * 1024) == align_up(1024 * 8 + 127 * 96, 128)
    assert config.step_rows(8 * 1024) <= config.shard_rows()
    assert config.expert_bytes() == 3 * 7168 * 2048 * 2
    assert config.shard_bytes() == config.shard_rows() * 7168 * 2


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"experts": 15}, "experts must be divisible by ranks"),
        ({"top_k": 17}, "top_k must be <= experts"),
        ({"hidden": 0}, "hidden must be a positive integer"),
        ({"capacity": -1}, "capacity must be a positive integer"),
        ({"align": 1.5}, "align must be a positive integer"),
        ({"tolerance": -0.1}, "tolerance must be a finite number >= 0"),
        ({"tolerance": float("inf")}, "tolerance must be a finite number >= 0"),
        ({"tolerance": "1"}, "tolerance must be a finite number >= 0"),
    ],
)
def test_invalid_values_name_the_field(changes, message):
    base = dict(ranks=2, experts=16, top_k=2, hidden=8, intermediate=8, capacity=4)
    with pytest.raises(ValueError, match=message):
        EPConfig(**{**base, **changes})


def test_step_rows_rejects_out_of_range_tokens():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=4)
    with pytest.raises(ValueError, match="total_tokens"):
        config.step_rows(9)
    with pytest.raises(ValueError, match="policy"):
        config.step_rows(4, "fast")


def test_presets():
    for model in MODEL_SHAPES:
        assert preset(model).ranks == 8
    k3 = preset("kimi-k3")
    assert (k3.hidden, k3.experts, k3.top_k, k3.intermediate) == (3584, 896, 16, 3072)
    with pytest.raises(ValueError, match="model must be one of"):
        preset("llama")


def test_tolerance_sets_the_rebalance_limit_and_grows_the_shard():
    strict = EPConfig(ranks=8, experts=384, top_k=8, hidden=7168, intermediate=2048, capacity=1024)
    loose = strict.replace(tolerance=0.5)
    assert strict.rebalance_limit(8 * 1000) == 8000 and loose.rebalance_limit(8 * 1000) == 12000
    assert strict.rebalance_limit(7) == 7 * 8 // 8  # floor(T*K/R): only even steps stay unbalanced
    assert strict.step_rows(8 * 1024) == align_up(1024 * 8 + 127 * 96, 128)
    assert loose.step_rows(8 * 1024) == align_up(1536 * 8 + 127 * 96, 128)
    assert loose.step_rows(8 * 1024, "none") == strict.step_rows(8 * 1024, "none")


def test_rebalance_limit_is_the_fixed_point_formula():
    from fractions import Fraction

    from flatep.config import TOLERANCE_SCALE, rows_bound

    for tolerance in (0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0, 4.0, 1024):
        config = EPConfig(ranks=8, experts=384, top_k=8, hidden=8, intermediate=8, capacity=8192, tolerance=tolerance)
        fixed = round(tolerance * 2**20)
        assert config.tolerance_fixed == fixed
        for tokens in (1, 7, 999, 8 * 8192):
            entries = tokens * 8
            expected = (entries * (2**20 + fixed)) // (8 * 2**20)
            assert config.rebalance_limit(tokens) == expected == rows_bound(entries, 8, fixed)
            # The integer formula is the exact floor of the rational bound.
            assert expected == int(Fraction(entries) * (1 + Fraction(fixed, TOLERANCE_SCALE)) / 8)
            assert config.bounded_rows(tokens) == max(-(-entries // 8), expected)


def test_bounded_shards_hold_the_bound():
    config = EPConfig(ranks=8, experts=384, top_k=8, hidden=8, intermediate=8, capacity=1024, tolerance=0.5)
    assert config.step_rows(8 * 1024, "bounded") == config.step_rows(8 * 1024, "exact")
    assert config.step_rows(8 * 1024, "bounded") == align_up(1536 * 8 + 127 * 96, 128)
    # Odd totals: b is never below ceil(T*K/R).
    tight = EPConfig(ranks=3, experts=3, top_k=1, hidden=8, intermediate=8, capacity=4)
    assert tight.bounded_rows(4) == 2 and tight.rebalance_limit(4) == 1


def test_tolerance_above_the_fixed_point_range_is_rejected():
    base = dict(ranks=2, experts=16, top_k=2, hidden=8, intermediate=8, capacity=4)
    EPConfig(**base, tolerance=1024)
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0 and <= 1024"):
        EPConfig(**base, tolerance=1024.5)


def test_step_align_pads_decode_steps_less_and_keeps_align_for_large_steps():
    from flatep import preset

    config = preset("kimi-k2", ranks=8, capacity=8192)  # E=384, K=8, align 128
    assert [config.step_align(8 * s) for s in (1, 8, 32, 64, 128, 1024, 8192)] == [16, 16, 16, 16, 32, 128, 128]
    small = EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=64, align=4)
    assert {small.step_align(t) for t in range(1, 129)} == {4}  # never above align, even below 16
    odd = EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=64, align=24)
    assert {odd.step_align(t) for t in range(1, 129)} <= {16, 24}
    for policy in ("exact", "none", "bounded", "auto"):
        rows = [config.step_rows(total, policy) for total in range(1, 8 * 8192 + 1, 97)]
        assert rows == sorted(rows) and max(rows) <= config.shard_rows(policy)  # capacity buffers hold every step
