"""The collective transport with 2 and 4 gloo processes equals the local transport bit for bit.

Workers (:mod:`tests.transport.worker`) run ``ep_moe`` per process and save their outputs; this
process computes the local-transport references once and compares. The workers run without the
Triton interpreter, so their experts take the plain-torch path, and the reference is the local
plain-torch path (bit-equal in bf16 and fp32). The Triton experts kernel computes ``exp``
differently from torch, so against the local Triton kernels the check is one of closeness (their
agreement is checked in ``tests/kernels``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flatep import EPConfig, dense_moe, ep_moe, init_group, make_plan, plan_rank
from flatep.kernels.backend import interpreting
from flatep.plan import histogram
from flatep.routing import adversarial_topk, skewed_topk
from flatep.transport.collective import receive_order, send_order
from tests.helpers import DEVICE, HostReadGuard, launch_workers, relative_error, tolerance
from tests.transport.backward_worker import CASES, backward_steps, case_name
from tests.transport.worker import bits, cases, padded_case, padded_counts

WORKER_TIMEOUT = 120


@contextlib.contextmanager
def cpu_processes(interpret: bool = False) -> Iterator[None]:
    """Workers started inside run on CPU, with the Triton interpreter only if ``interpret`` (the
    test session's conftest turns it on; without it the experts take the plain-torch path)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU processes, also on a machine with a GPU
        yield


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch's CPU ops on one thread inside (the thread count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def launch(world: int, directory: Path, *arguments: str, interpret: bool = False) -> list[dict[str, object]]:
    """Run ``world`` worker processes over a gloo group; return each rank's saved results ({} if none).

    Without ``interpret`` the experts take the plain-torch path (bit-equal to the local torch path).
    """
    with cpu_processes(interpret):
        launch_workers(
            "tests.transport.worker", world,
            ["--backend", "gloo", "--init-method", f"file://{directory}/store", "--out", str(directory), *arguments],
            WORKER_TIMEOUT,
        )
    return [torch.load(path) if (path := directory / f"rank{rank}.pt").exists() else {} for rank in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def equivalence_run(request, tmp_path_factory):
    world = request.param
    # transport=auto: CPU processes must get the collective transport.
    return world, launch(world, tmp_path_factory.mktemp(f"collective{world}"), "--transport", "auto", "--suite", "equivalence")


def test_collective_equals_local_transport_and_dense(equivalence_run):
    world, results = equivalence_run
    assert all(result["group"].startswith("CollectiveGroup(") for result in results), [r["group"] for r in results]
    group = init_group("local", ranks=world, device="cpu")
    for case in cases(world, "small"):
        x, ids, weights, w13, w2 = case.inputs(torch.device("cpu"))
        torch_path = ep_moe(x, ids, weights, w13, w2, config=case.config, group=group, backend="torch", **case.options)
        dense = dense_moe(case.seen_by_experts(x), ids, weights, w13, w2)
        kernels = None
        if case.dtype == torch.float32 and interpreting():
            kernels = ep_moe(x, ids, weights, w13, w2, config=case.config, group=group, backend="triton", **case.options)
        for rank in range(world):
            out = results[rank][case.name]
            assert out.shape == x[rank].shape and out.dtype == case.dtype
            assert torch.equal(bits(out), bits(torch_path[rank])), f"{case.name} rank {rank}: differs from the local torch path"
            if kernels is not None:
                assert relative_error(out, kernels[rank]) < 1e-6, f"{case.name} rank {rank}: differs from the local kernels"
            assert relative_error(out, dense[rank]) < tolerance(case.dtype), case.name


@pytest.mark.parametrize("world", [2, 4])
def test_static_splits_read_nothing_back_and_equal_host_sized_messages(world, tmp_path):
    """static_splits=True: every case, dedup off and on, bit-identical to the default exchange, with
    the static group's dispatch, combine and gather_entries (the backward's return of each route
    weight's gradient) under HostReadGuard (no value read back to the host); what reads the host
    refuses to run inside CUDA-graph capture."""
    results = launch(world, tmp_path, "--transport", "collective", "--suite", "static")
    for rank, result in enumerate(results):
        assert result["group"].startswith("CollectiveGroup("), result
        checks = {name: value for name, value in result.items() if "/dedup=" in name}
        assert len(checks) == 2 * len(cases(world, "small")) + 3, sorted(checks)  # + ragged tokens, backward (x, route)
        assert all(value is True for value in checks.values()), (rank, [v for v in checks.values() if v is not True])
        # Inside CUDA-graph capture the host-sized exchange and the push refuse, saying what to do instead.
        assert all(result[f"capture/{what}"] is True for what in ("dispatch", "gather_entries", "push")), result


@pytest.mark.parametrize("world", [2, 3])
def test_random_steps_equal_the_local_transport(world, tmp_path):
    """Random steps (formats, policies, skew, per-rank token counts, dedup, fp8 dispatch; the worker's
    ``random_step``): every rank's real rows bit-equal to the local transport's, 3 processes included."""
    results = launch(world, tmp_path, "--transport", "collective", "--suite", "random", "--steps", "40")
    for rank, result in enumerate(results):
        steps = {name: value for name, value in result.items() if name.startswith("seed")}
        assert len(steps) == 40, (rank, sorted(result))
        assert [name for name, same in steps.items() if same is not True] == [], rank


@pytest.mark.parametrize("world", [2, 4])
def test_one_push_moves_every_pool_of_a_layer(world, tmp_path):
    results = launch(world, tmp_path, "--transport", "collective", "--suite", "push-pools")
    assert [result["push-pools"] for result in results] == [True] * world


def test_static_splits_only_on_the_collective_transport():
    with pytest.raises(ValueError, match="static_splits is for the collective transport"):
        init_group("local", ranks=2, device="cpu", static_splits=True)
    with pytest.raises(ValueError, match="static_splits must be True or False"):
        init_group("local", ranks=2, device="cpu", static_splits=1)


def test_the_host_read_guard_catches_reads_and_lets_device_side_work_through():
    values = torch.arange(10)
    mask = values > 3
    for read in (values.tolist, values[0].item, lambda: values[mask], lambda: mask.nonzero(), lambda: int(values[0]),
                 lambda: torch.bincount(values), lambda: torch.repeat_interleave(values, values), values.cpu):
        with pytest.raises(RuntimeError, match="host read"), HostReadGuard():
            read()
    with HostReadGuard():
        picked = torch.where(mask, values, 0)[torch.tensor([3, 4])]
        torch.sort(values).indices.cumsum(0)
    assert picked.tolist() == [0, 4]


def test_memory_after_50_steps_of_20_sizes_equals_the_first_steps(equivalence_run):
    """Per-process buffers are sized from the capacity: no step allocates after the first."""
    _, results = equivalence_run
    for result in results:
        held = result["buffer-bytes"]
        assert len(held) == 50 and held[0] > 0 and held == [held[0]] * 50, sorted(set(held))


def test_ranks_with_fewer_real_tokens_equal_the_local_transport(equivalence_run):
    world, results = equivalence_run
    case = padded_case(world, "small")
    x, ids, weights, w13, w2 = case.inputs(torch.device("cpu"))
    real = padded_counts(world, case.tokens)
    group = init_group("local", ranks=world, device="cpu")
    plan = make_plan(ids, case.config, case.policy, tokens=real)
    local = ep_moe(x, ids, weights, w13, w2, config=case.config, group=group, policy=case.policy, plan=plan, backend="torch")
    for rank in range(world):
        assert torch.equal(bits(results[rank]["padded"]), bits(local[rank]))
        assert not results[rank]["padded"][real[rank]:].any()


def test_disagreement_and_bad_input_raise_on_every_rank(equivalence_run):
    world, results = equivalence_run
    for rank, result in enumerate(results):
        assert "s [16, " in result["disagree-s"] and "every rank raises" in result["disagree-s"]
        assert "align [4, 8" in result["disagree-config"]
        assert "tolerance [0.0, 0.5" in result["disagree-tolerance"]
        assert "dispatch [0, 1" in result["disagree-dispatch"]
        if rank == world - 1:
            assert "is not an expert id" in result["bad-ids"]
        else:
            assert f"rank(s) [{world - 1}] passed invalid inputs" in result["bad-ids"]
        # The group is still usable afterwards: the same step gives the same output again.
        assert torch.equal(result["after-errors"], result[result["after-errors/case"]])


def test_a_rank_that_dies_makes_the_others_raise(tmp_path):
    results = launch(2, tmp_path, "--transport", "collective", "--suite", "dead-rank", "--timeout", "10")
    survivor = results[0]
    assert survivor["dead/type"] != "none", "the step finished although a rank was gone"
    assert survivor["dead/elapsed"] < 30


@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize(
    "ranks, experts, top_k, tokens, real, routing",
    [(2, 4, 2, 8, [8, 8], 3.0), (4, 16, 4, 9, [9, 3, 0, 9], 1.0), (3, 3, 3, 5, [5, 5, 5], "one"), (4, 8, 1, 6, [6, 6, 6, 6], "next")],
)
def test_senders_and_receivers_derive_the_same_row_order(ranks, experts, top_k, tokens, real, routing, policy):
    """Rows from source ``r`` arrive at ``d`` in exactly the order ``r`` sends them, from the plan alone."""
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=8, intermediate=8, capacity=tokens, align=4)
    ids = (adversarial_topk(routing, ranks, experts, top_k, tokens) if isinstance(routing, str)
           else skewed_topk(ranks, experts, top_k, tokens, routing))
    plan = make_plan(ids, config, policy, tokens=real)
    valid = torch.arange(tokens).view(1, -1, 1) < torch.tensor(real).view(-1, 1, 1)
    gathered = histogram(ids, valid.expand_as(ids), experts)
    sent = []
    for source in range(ranks):
        own = plan_rank(source, ids[source], gathered, config, policy, total_tokens=sum(real), tokens=real[source])
        order, counts = send_order(own, ranks)
        entries = order[: int(counts.sum())]
        assert counts.tolist() == torch.bincount(own.dest_rank[own.dest_rank >= 0].long(), minlength=ranks).tolist()
        sent.append((own.dest_rank.reshape(-1)[entries], own.dest_row.reshape(-1)[entries], counts))
    for destination in range(ranks):
        rows, counts = receive_order(plan, destination)
        assert int(counts.sum()) == int(plan.received[destination])
        expected = torch.cat([row[rank == destination] for rank, row, _ in sent])
        assert torch.equal(rows[: int(counts.sum())], expected.long())
        assert counts.tolist() == [int(source_counts[destination]) for _, _, source_counts in sent]


def test_epmoe_per_process_holds_its_own_experts_and_equals_dense(tmp_path):
    with cpu_processes():
        output = launch_workers("tests.transport.epmoe_worker", 2, [f"file://{tmp_path}/store"], WORKER_TIMEOUT)
    assert output.count("equals the dense MoE") == 2, output
    assert output.count("trains like the local transport") == 2, output


@pytest.mark.parametrize("world", [2, 4])
def test_steps_without_eager_checks_equal_the_local_transport_and_report_bad_ids_on_check(world, tmp_path):
    """eager_check=False: nothing is read back per step; the Triton planner (interpreted) plans and
    the results equal the local transport; bad ids on one rank surface at every rank's check()."""
    results = launch(world, tmp_path, "--transport", "collective", "--suite", "lazy", interpret=True)
    # The reference runs the Triton kernels too: compiled on a GPU, interpreted on a CPU-only machine.
    group = init_group("local", ranks=world, device=DEVICE)
    for case in cases(world, "small")[:4]:
        x, ids, weights, w13, w2 = case.inputs(torch.device("cpu"))
        local = ep_moe(*(t.to(DEVICE) for t in (x, ids, weights, w13, w2)), config=case.config, group=group,
                       policy=case.policy, backend="triton").cpu()
        for rank in range(world):
            # bf16: the interpreter rounds the experts' activations unlike torch (see the module docstring)
            assert relative_error(results[rank][case.name], local[rank]) < tolerance(case.dtype), (case.name, rank)
            assert relative_error(results[rank][case.name], dense_moe(x, ids, weights, w13, w2)[rank]) < tolerance(case.dtype)
    # Ragged real tokens, planned without reading the group's total: the host-side sizes take the bound R*s.
    case = padded_case(world, "small")
    x, ids, weights, w13, w2 = case.inputs(torch.device("cpu"))
    real = padded_counts(world, case.tokens)
    plan = make_plan(ids.to(DEVICE), case.config, case.policy, tokens=real)
    local = ep_moe(*(t.to(DEVICE) for t in (x, ids, weights, w13, w2)), config=case.config, group=group,
                   policy=case.policy, plan=plan, backend="triton").cpu()
    for rank, result in enumerate(results):
        assert relative_error(result["lazy-padded"], local[rank]) < tolerance(case.dtype), rank
        assert not result["lazy-padded"][real[rank]:].any() and result["lazy-padded/total"] == world * case.tokens
        assert "or no rank had tokens" in result["lazy-no-tokens"], result["lazy-no-tokens"]
    for rank, result in enumerate(results):
        assert "ranks disagreed on a step" in result["lazy-bad-ids"] and "or a rank's inputs were invalid" in result["lazy-bad-ids"]
        assert ("expert id outside" in result["lazy-bad-ids"]) == (rank == world - 1)
        assert torch.equal(result["lazy-after-errors"], result[result["lazy-after-errors/case"]])


def test_a_closed_group_lets_go_of_its_process_group(tmp_path):
    """A group kept alive past destroy_process_group() (in a model, say) must not keep gloo's threads
    alive: they could abort the process at exit. close() lets go, and a closed group says so."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = init_group(transport="collective", device="cpu")
        assert group.process_group is dist.group.WORLD
        group.close()
        with pytest.raises(ValueError, match="is closed"):
            group.process_group
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="no process group"):
        init_group("local", ranks=2, device="cpu").process_group


@pytest.mark.parametrize("world", [2, 4])
def test_backward_equals_the_local_transports_gradients(world, tmp_path):
    """ep_moe with grad per process: out and the gradients of x, topk_weights, w13, w2 (and biases),
    gathered over the ranks, equal the local transport's bit for bit (same arithmetic, same order),
    with a routing that borrows (exact) and without (none), weights passed whole or as slices, and
    in random steps (group sizes, routings, exact, none and bounded)."""
    with cpu_processes():  # plain-torch experts, as the local reference below
        arguments = [f"file://{tmp_path}/store", str(tmp_path)]
        launch_workers("tests.transport.backward_worker", world, arguments, WORKER_TIMEOUT)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    group = init_group("local", ranks=world, device="cpu")
    fixed = {case_name(*case) for case in CASES}
    # As the workers run (launch_workers: OMP_NUM_THREADS=1): a small CPU matmul's last bits can
    # depend on how many threads split it (seen with the expert backward's odd real row counts).
    with one_thread():
        for step in backward_steps(world):
            name, config, policy, form, inputs = step.name, step.config, step.policy, step.form, step.inputs
            epn = config.experts_per_rank
            leaves = {key: None if inputs[key] is None else inputs[key].clone().requires_grad_()
                      for key in ("x", "topk_weights", "w13", "w2", "b13", "b2")}
            out = ep_moe(leaves["x"], inputs["topk_ids"], leaves["topk_weights"], leaves["w13"], leaves["w2"],
                         b13=leaves["b13"], b2=leaves["b2"], config=config, group=group, policy=policy, backend="torch")
            out.backward(inputs["grad_out"])
            if policy == "exact" and name in fixed:
                assert (make_plan(inputs["topk_ids"], config, policy).slot_experts >= 0).any(), "the routing must borrow"
            for key, leaf in leaves.items():
                if leaf is None:
                    assert all(key not in result[name] for result in results)
                    continue
                if key in ("x", "topk_weights"):
                    got = torch.stack([result[name][key] for result in results])
                elif form == "slice":
                    got = torch.cat([result[name][key] for result in results])
                else:  # each rank's [E, ...] gradient covers its home experts only
                    for rank, result in enumerate(results):
                        others = torch.ones(config.experts, dtype=torch.bool)
                        others[rank * epn : (rank + 1) * epn] = False
                        assert not result[name][key][others].any(), (name, key, rank)
                    got = torch.cat([result[name][key][rank * epn : (rank + 1) * epn]
                                     for rank, result in enumerate(results)])
                assert torch.equal(bits(got), bits(leaf.grad)), (name, key, relative_error(got, leaf.grad))
            assert torch.equal(bits(torch.stack([result[name]["out"] for result in results])), bits(out.detach())), name


@pytest.mark.parametrize("policy", ["exact", "none"])
def test_gather_entries_returns_each_entrys_row_unsummed(policy, tmp_path):
    """One process (R = 1): gather_entries(values)[t, k] is the row entry (t, k) was dispatched to,
    read through the all-to-all; padded entries get zeros."""
    import torch.distributed as dist

    from flatep.layer import plan_step

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = init_group(transport="collective", device="cpu")
    try:
        config = EPConfig(ranks=1, experts=3, top_k=2, hidden=8, intermediate=8, capacity=6, align=4)
        ids = skewed_topk(1, 3, 2, 6, 1.0)[0]
        plan = plan_step(ids, config, group, policy, tokens=5)
        values = torch.randn(plan.shard_rows, 3)
        got = group.gather_entries(values, plan)
        assert got.shape == (6, 2, 3)
        planned = plan.dest_rank >= 0
        assert torch.equal(got[planned], values[plan.dest_row[planned].long()])
        assert not got[~planned].any() and (~planned[5]).all()
    finally:
        group.close()
        dist.destroy_process_group()
