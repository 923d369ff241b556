"""The timing helpers: interleaved rounds, warm-up, and the statistics they report."""
import pytest
import torch

from flatep.bench.timing import experts_outputs, time_interleaved, time_stats

CPU = torch.device("cpu")


def _recorder(calls: list[str], name: str):
    return lambda: calls.append(name)


def test_rounds_time_every_function_once_with_the_order_rotated():
    calls: list[str] = []
    timings = time_interleaved([_recorder(calls, name) for name in "abc"], CPU, warmup=2, iters=4)
    assert len(timings) == 3
    warm, timed = calls[:6], calls[6:]
    assert warm == list("abcabc")
    # round i starts with function i % 3, so no function always runs first (or right after another)
    assert timed == list("abc" "bca" "cab" "abc")


def test_time_stats_matches_one_function_timed_alone():
    calls: list[str] = []
    timing = time_stats(_recorder(calls, "a"), CPU, warmup=1, iters=3)
    assert calls == ["a"] * 4 and timing.min <= timing.median <= timing.max


@pytest.mark.parametrize("kwargs, message", [(dict(iters=0), "iters must be >= 1"), (dict(fns=[]), "at least one")])
def test_bad_arguments_are_named(kwargs, message):
    arguments = dict(fns=[lambda: None], device=CPU, iters=2) | kwargs
    with pytest.raises(ValueError, match=message):
        time_interleaved(**arguments)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graph_rounds_replay_each_captured_function():
    device = torch.device("cuda")
    counters = [torch.zeros((), device=device) for _ in range(2)]
    fns = [lambda counter=counter: counter.add_(1) for counter in counters]
    timings = time_interleaved(fns, device, warmup=2, iters=5, graph=True, calls=3)
    torch.cuda.synchronize()
    # one eager call, then (2 warm-up + 5 timed) replays of 3 captured calls
    assert [int(counter) for counter in counters] == [1 + 7 * 3] * 2
    assert all(timing.median > 0 for timing in timings)


@pytest.mark.parametrize("stacked", [True, False])
def test_experts_outputs_are_views_of_one_buffer_shaped_like_each_shard(stacked):
    """One buffer for the tallest shard, a view of it shaped like each shard, none of them a shard's memory."""
    lead = (3,) if stacked else ()
    shards = [torch.randn(*lead, rows, 8).bfloat16() for rows in (5, 12, 7)]
    outputs = experts_outputs(shards)
    assert [out.shape for out in outputs] == [shard.shape for shard in shards]
    assert all(out.dtype == torch.bfloat16 and out.stride(-1) == 1 for out in outputs)
    assert len({out.untyped_storage().data_ptr() for out in outputs}) == 1
    assert outputs[0].untyped_storage().nbytes() == shards[1].untyped_storage().nbytes()
    assert not any(out.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
                   for out in outputs for shard in shards)
