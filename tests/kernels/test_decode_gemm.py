"""Decode kernels (interpreter on CPU, small shapes) against torch's grouped GEMM and the unfused SwiGLU."""
import pytest
import torch

from flatep.experts.grouped import grouped_swiglu, takes_decode_kernels
from flatep.kernels.activation import swiglu_weighted_torch
from flatep.kernels.decode_gemm import (
    HOT_ROWS, HOT_TILES, decode_config, decode_launches, gate_up_swiglu_triton, grouped_mm_triton,
)
from flatep.kernels.packed_tiles import GemmConfig
from tests.helpers import DEVICE

CONFIGS = [None, GemmConfig(16, 32, 32, swap_ab=False), GemmConfig(32, 16, 64, swap_ab=True)]


def _operands(counts, hidden=96, inter=48, seed=0):
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = int(offsets[-1]) + 5  # rows past the groups stay unwritten
    x = torch.randn(rows, hidden, generator=generator).bfloat16()
    w13 = (torch.randn(len(counts), 2 * inter, hidden, generator=generator) * 0.1).bfloat16()
    w2 = (torch.randn(len(counts), hidden, inter, generator=generator) * 0.1).bfloat16()
    route_weights = torch.rand(rows, generator=generator)
    return tuple(tensor.to(DEVICE) for tensor in (x, w13, w2, route_weights, offsets))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("counts", [[3, 0, 17, 1], [0, 0, 40]])
def test_grouped_mm_equals_torch(config, counts):
    x, w13, w2, _, offsets = _operands(counts)
    end = int(offsets[-1])
    out = torch.full((x.shape[0], w2.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    rows = x[:, : w2.shape[2]].contiguous()
    grouped_mm_triton(rows, w2, offsets, config, out=out)
    expected = torch._grouped_mm(rows, w2.mT, offs=offsets)
    torch.testing.assert_close(out[:end].float(), expected[:end].float(), rtol=1e-2, atol=1e-2)
    assert out[end:].isnan().all()


@pytest.mark.parametrize("config", CONFIGS)
def test_gate_up_swiglu_equals_the_unfused_steps(config):
    x, w13, _, route_weights, offsets = _operands([5, 9, 0, 2], seed=1)
    end = int(offsets[-1])
    route_weights[0] = float("nan")  # propagates into its row, as in a dense MoE
    hidden_states = torch._grouped_mm(x, w13.mT, offs=offsets)
    expected = swiglu_weighted_torch(hidden_states.float(), route_weights, torch.bfloat16)
    out = torch.full((x.shape[0], w13.shape[1] // 2), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gate_up_swiglu_triton(x, w13, route_weights, offsets, config, out=out)
    assert out[0].isnan().all()
    torch.testing.assert_close(out[1:end].float(), expected[1:end].float(), rtol=2e-2, atol=1e-3)
    assert out[end:].isnan().all()


@pytest.mark.parametrize("config", CONFIGS)
def test_gate_up_swiglu_propagates_nan_rows_as_a_dense_moe(config):
    """A row holding NaN gives NaN gate and up values, and NaN activations, as the unfused steps
    give: the epilogue's bf16 rounding used to turn the GPU's NaN (bits 0x7FFFFFFF) into -0, and
    the row came out finite."""
    x, w13, _, route_weights, offsets = _operands([5, 9, 0, 2], seed=2)
    end = int(offsets[-1])
    x[3, 7] = float("nan")
    x[8] = float("nan")
    out = torch.full((x.shape[0], w13.shape[1] // 2), float("inf"), dtype=torch.bfloat16, device=DEVICE)
    gate_up_swiglu_triton(x, w13, route_weights, offsets, config, out=out)
    assert out[3].isnan().all() and out[8].isnan().all()
    finite = [row for row in range(end) if row not in (3, 8)]
    assert out[finite].isfinite().all()


def test_default_tiles_follow_rows_per_group():
    assert decode_config(16, 16).block_m == 16
    assert decode_config(32 * 48, 48).block_m == 32
    assert decode_config(200 * 48, 48).block_m == 64
    assert decode_config(16, 16).swap_ab


def test_bad_operands_are_rejected():
    x, w13, w2, route_weights, offsets = _operands([2, 2])
    with pytest.raises(ValueError, match="rows must be"):
        grouped_mm_triton(x.float(), w13, offsets)
    with pytest.raises(ValueError, match="weights must be"):
        grouped_mm_triton(x, w2, offsets)
    with pytest.raises(ValueError, match="offsets must be"):
        grouped_mm_triton(x, w13, offsets.long())
    with pytest.raises(ValueError, match="route_weights must be"):
        gate_up_swiglu_triton(x, w13, route_weights.double(), offsets)
    for option in ("rescale", "lane_words"):
        with pytest.raises(ValueError, match=f"{option} is an .* tile option, not one of the bf16"):
            grouped_mm_triton(x[:, :w2.shape[2]].contiguous(), w2, offsets, GemmConfig(16, 32, 32, **{option: True}))


def test_decode_kernels_run_on_cuda_decode_shards_only():
    """The rows per group decide, not the buffer's size: a layer's shard is sized for a full step."""
    x, w13, w2, route_weights, _ = _operands([2, 2])
    assert takes_decode_kernels(x, route_weights, w13, w2, 2) == x.is_cuda
    assert not takes_decode_kernels(x.float(), route_weights, w13, w2, 2)
    many_rows = torch.empty(1000, x.shape[1], dtype=x.dtype, device=x.device)
    assert not takes_decode_kernels(many_rows, route_weights, w13, w2, 1000 // 2)
    assert takes_decode_kernels(many_rows, route_weights, w13, w2, 2) == x.is_cuda
    for other in (dict(precision="native"), dict(biased=True), dict(activation=lambda g, u: g * u), dict(backend="torch")):
        assert not takes_decode_kernels(x, route_weights, w13, w2, 2, **other)


def _two_sets(home_counts, slot_counts, slot_base, hidden=96, inter=48, seed=4):
    """Operands of one launch over two weight sets: home groups from row 0, slot groups from
    ``slot_base``; the rows in between and past the last group belong to no group."""
    generator = torch.Generator().manual_seed(seed)
    home_offsets = torch.tensor(home_counts).cumsum(0)
    slot_offsets = slot_base + torch.tensor(slot_counts).cumsum(0)
    offsets = torch.cat([home_offsets, slot_offsets]).to(torch.int32)
    rows = int(offsets[-1]) + 3
    x = torch.randn(rows, hidden, generator=generator).bfloat16()
    weights = [(torch.randn(len(counts), 2 * inter, hidden, generator=generator) * 0.1).bfloat16() for counts in (home_counts, slot_counts)]
    downs = [(torch.randn(len(counts), hidden, inter, generator=generator) * 0.1).bfloat16() for counts in (home_counts, slot_counts)]
    route_weights = torch.rand(rows, generator=generator)
    return [t.to(DEVICE) for t in (x, *weights, *downs, route_weights, offsets)]


@pytest.mark.parametrize("slot_counts", [[4, 0, 7], [0, 0, 0]])
def test_two_weight_sets_in_one_launch_equal_two_launches(slot_counts):
    """Home experts and borrow slots in one launch (groups past the home ones start at
    ``slot_base`` and read the second set) give each part's launch's rows; no other row is written."""
    home_counts, slot_base = [3, 0, 6], 16
    x, w13, slot_w13, w2, slot_w2, route_weights, offsets = _two_sets(home_counts, slot_counts, slot_base)
    epn, home_end, end = len(home_counts), int(offsets[len(home_counts) - 1]), int(offsets[-1])
    inter = w2.shape[2]
    activated = torch.full((x.shape[0], inter), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gate_up_swiglu_triton(x, w13, route_weights, offsets, out=activated, slots=slot_w13, slot_base=slot_base)
    out = torch.full((x.shape[0], w2.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    grouped_mm_triton(activated, w2, offsets, out=out, slots=slot_w2, slot_base=slot_base)
    for first, last, gate_up, down, part_offsets in (
        (0, home_end, w13, w2, offsets[:epn]),
        (slot_base, end, slot_w13, slot_w2, offsets[epn:] - slot_base),
    ):
        part_activated = gate_up_swiglu_triton(x[first:], gate_up, route_weights[first:].contiguous(), part_offsets.contiguous())
        part_out = grouped_mm_triton(part_activated, down, part_offsets.contiguous())
        torch.testing.assert_close(activated[first:last].float(), part_activated[: last - first].float(), rtol=0, atol=0)
        torch.testing.assert_close(out[first:last].float(), part_out[: last - first].float(), rtol=0, atol=0)
    assert out[home_end:slot_base].isnan().all() and out[end:].isnan().all()
    assert activated[home_end:slot_base].isnan().all() and activated[end:].isnan().all()


def test_two_weight_sets_are_checked():
    x, w13, slot_w13, w2, slot_w2, route_weights, offsets = _two_sets([2, 2], [1, 1], 8)
    with pytest.raises(ValueError, match="slots must be"):
        grouped_mm_triton(x, w13, offsets, slots=slot_w13[:, :3])
    with pytest.raises(ValueError, match="slot_base must be"):
        grouped_mm_triton(x, w13, offsets, slots=slot_w13, slot_base=x.shape[0] + 1)
    with pytest.raises(ValueError, match=r"offsets must be a contiguous \[4\]"):
        grouped_mm_triton(x, w13, offsets[:2].contiguous(), slots=slot_w13, slot_base=8)
    with pytest.raises(ValueError, match="slots run in the launches of the decode kernels"):
        grouped_swiglu(x, route_weights, w13, w2, offsets, backend="torch", slots=(slot_w13, slot_w2), slot_base=8)


@pytest.mark.parametrize("rows_per_group", [None, 4, 40])
def test_grouped_swiglu_takes_the_decode_kernels_with_the_step_tiles(monkeypatch, rows_per_group):
    """grouped_swiglu's decode branch (forced on here: on CPU the shapes test is CUDA-only) runs the
    kernels with tiles for ``rows_per_group`` (default: the shard's rows per group), never for the
    buffer's size, and equals the GEMM path."""
    import flatep.experts.grouped as grouped
    from flatep.kernels.backend import use_triton

    if not use_triton(torch.device(DEVICE)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    x, w13, w2, route_weights, offsets = _operands([5, 9, 0, 2], seed=3)
    end = int(offsets[-1])
    expected = grouped.grouped_swiglu(x, route_weights, w13, w2, offsets, backend="torch")
    import flatep.kernels.decode_gemm as decode_gemm

    seen = []
    launch = decode_gemm.gate_up_swiglu_triton
    monkeypatch.setattr(grouped, "takes_decode_kernels", lambda *args, **kwargs: True)
    monkeypatch.setattr(decode_gemm, "gate_up_swiglu_triton",
                        lambda *args, **kwargs: seen.append(args[4]) or launch(*args, **kwargs))
    got = grouped.grouped_swiglu(x, route_weights, w13, w2, offsets, rows_per_group=rows_per_group)
    assert seen == [decode_config((rows_per_group or -(-x.shape[0] // 4)) * 4, 4), HOT_TILES]
    torch.testing.assert_close(got[:end].float(), expected[:end].float(), rtol=3e-2, atol=3e-3)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_launch_computes_only_the_groups_in_its_row_range(config):
    """``group_rows=(above, at_most)``: groups of 5 and 17 rows are computed, the others (3, 1,
    0 and 40 rows) keep the poison; two launches over complementary ranges give one launch's rows."""
    counts = [3, 5, 0, 17, 1, 40]
    x, w13, w2, route_weights, offsets = _operands(counts, seed=4)
    rows = x[:, : w2.shape[2]].contiguous()
    whole = grouped_mm_triton(rows, w2, offsets, config)
    out = torch.full((x.shape[0], w2.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    grouped_mm_triton(rows, w2, offsets, config, out=out, group_rows=(4, 20))
    starts = [0] + offsets[:-1].tolist()
    for count, start in zip(counts, starts):
        inside = out[start:start + count]
        if 4 < count <= 20:
            torch.testing.assert_close(inside.float(), whole[start:start + count].float(), rtol=0, atol=0)
        else:
            assert inside.isnan().all()
    grouped_mm_triton(rows, w2, offsets, config, out=out, group_rows=(0, 4))
    grouped_mm_triton(rows, w2, offsets, config, out=out, group_rows=(20, 2**31 - 1))
    end = int(offsets[-1])
    torch.testing.assert_close(out[:end].float(), whole[:end].float(), rtol=0, atol=0)
    activated = torch.full((x.shape[0], w13.shape[1] // 2), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    for group_rows in ((0, 16), (16, 2**31 - 1)):
        gate_up_swiglu_triton(x, w13, route_weights, offsets, config, out=activated, group_rows=group_rows)
    torch.testing.assert_close(activated[:end].float(), gate_up_swiglu_triton(x, w13, route_weights, offsets, config)[:end].float(),
                               rtol=0, atol=0)


def test_hot_groups_run_in_a_launch_of_their_own(monkeypatch):
    """Groups above HOT_ROWS rows take HOT_TILES in a second launch; the step still equals the GEMM path."""
    import flatep.experts.grouped as grouped
    from flatep.kernels.backend import use_triton

    if not use_triton(torch.device(DEVICE)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    assert decode_launches(32 * 4, 4) == [(decode_config(32 * 4, 4), (0, HOT_ROWS)), (HOT_TILES, (HOT_ROWS, 2**31 - 1))]
    assert decode_launches(32 * 4, 4, hot=None) == [(decode_config(32 * 4, 4), (0, 2**31 - 1))]
    x, w13, w2, route_weights, offsets = _operands([5, HOT_ROWS + 9, 0, HOT_ROWS], hidden=64, inter=32, seed=5)
    end = int(offsets[-1])
    expected = grouped.grouped_swiglu(x, route_weights, w13, w2, offsets, backend="torch")
    monkeypatch.setattr(grouped, "takes_decode_kernels", lambda *args, **kwargs: True)
    got = grouped.grouped_swiglu(x, route_weights, w13, w2, offsets, rows_per_group=16)
    torch.testing.assert_close(got[:end].float(), expected[:end].float(), rtol=3e-2, atol=3e-3)


def test_bad_group_rows_are_rejected():
    x, w13, w2, _, offsets = _operands([3, 5])
    rows = x[:, : w2.shape[2]].contiguous()
    for bad in ((5, 4), (-1, 3), [0, 3], (0, 2**31), (0.5, 3)):
        with pytest.raises(ValueError, match="group_rows must be"):
            grouped_mm_triton(rows, w2, offsets, group_rows=bad)
