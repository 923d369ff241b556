"""The backward of ep_moe and EPMoE on the local transport equals a dense fp64 MoE's, run after run."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flatep import CostProfile, EPConfig, EPMoE, ExpertPool, ep_moe, init_group, plan_step
from flatep.experts.grouped import ClampedSwiGLU, swiglu
from flatep.layer import prefetch_experts
from flatep.quant.tensor import QuantizedTensor
from tests.helpers import DEVICE, make_inputs, relative_error

NAMES = ("x", "topk_weights", "w13", "w2", "b13", "b2")


def leaves(config: EPConfig, tokens: int, routing, dtype=torch.float32, seed=0, biases=True):
    """Inputs of one step, every float one a leaf that requires grad; ids without grad."""
    x, ids, weights, w13, w2 = make_inputs(config, tokens, routing, dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    b13 = (torch.randn(config.experts, 2 * config.intermediate, generator=generator) * 0.1).to(DEVICE, dtype)
    b2 = (torch.randn(config.experts, config.hidden, generator=generator) * 0.1).to(DEVICE, dtype)
    tensors = dict(x=x, topk_weights=weights, w13=w13, w2=w2, b13=b13, b2=b2)
    if not biases:
        tensors["b13"] = tensors["b2"] = None
    for tensor in tensors.values():
        if tensor is not None:
            tensor.requires_grad_()
    return ids, tensors


def dense_reference(ids, x, topk_weights, w13, w2, b13=None, b2=None, activation=swiglu):
    """``sum_k w * (W2 act(W13 x + b13) + b2)`` per token in x's dtype (fp64 here), ids ``< 0`` skipped: ``[.., s, H]``."""
    intermediate = w2.shape[-1]
    experts = ids.clamp_min(0).long()
    projected = torch.einsum("...kih,...h->...ki", w13[experts], x)
    if b13 is not None:
        projected = projected + b13[experts]
    activated = activation(projected[..., :intermediate], projected[..., intermediate:])
    out = torch.einsum("...khi,...ki->...kh", w2[experts], activated)
    if b2 is not None:
        out = out + b2[experts]
    weights = torch.where(ids >= 0, topk_weights, 0.0)
    return (weights.unsqueeze(-1) * out).sum(-2)


def gradients(fn, tensors: dict, grad_out: torch.Tensor) -> dict:
    """``{name: d(sum(fn(**tensors) * grad_out)) / d tensor}`` for the tensors that require grad."""
    inputs = {name: tensor for name, tensor in tensors.items() if tensor is not None and tensor.requires_grad}
    out = fn(**tensors)
    return dict(zip(inputs, torch.autograd.grad(out, tuple(inputs.values()), grad_out)))


def check_against_dense(config, tokens, routing, policy, backend, biases=True, counts=None, seed=0, **options):
    """Gradients of one ep_moe step (``options``: more of its keywords) against the fp64 dense MoE's; returns its plan."""
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    ids, tensors = leaves(config, tokens, routing, seed=seed, biases=biases)
    cost = options.get("cost")
    plan = plan_step(ids, config, group, policy, tokens=counts, cost=cost) if counts is not None else None
    step = lambda x, topk_weights, w13, w2, b13, b2: ep_moe(  # noqa: E731
        x, ids, topk_weights, w13, w2, b13=b13, b2=b2, config=config, group=group, policy=policy, plan=plan,
        backend=backend, **options)
    grad_out = torch.randn(config.ranks, tokens, config.hidden, generator=torch.Generator().manual_seed(seed + 2))
    got = gradients(step, tensors, grad_out.to(DEVICE))
    reference_ids = ids.clone()
    if counts is not None:
        for rank, count in enumerate(counts):
            reference_ids[rank, count:] = -1
    fp64 = {name: None if t is None else t.detach().double().requires_grad_() for name, t in tensors.items()}
    activation = options.get("activation", swiglu)
    expected = gradients(lambda **t: dense_reference(reference_ids, **t, activation=activation), fp64,
                         grad_out.double().to(DEVICE))
    assert got.keys() == expected.keys()
    for name in got:
        assert got[name].dtype == tensors[name].dtype
        assert relative_error(got[name], expected[name]) < 2e-6, name
    return plan_step(ids, config, group, policy, cost=cost)


def small_config(ranks=2, experts_per_rank=2, top_k=2, hidden=16, intermediate=8, capacity=8):
    return EPConfig(ranks=ranks, experts=ranks * experts_per_rank, top_k=top_k, hidden=hidden,
                    intermediate=intermediate, capacity=capacity, align=4)


@pytest.mark.parametrize("policy", ["exact", "none", "auto"])
@pytest.mark.parametrize("routing", [1.0, "one", "next", "duplicate"])
@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_gradients_equal_a_dense_fp64_moe(policy, routing, tokens):
    plan = check_against_dense(small_config(ranks=4), tokens, routing, policy, "torch", seed=tokens)
    if policy == "exact" and routing == "one":  # every rank but the owner borrows the one hot expert
        assert (plan.slot_experts[1:, 0] >= 0).all()


def test_gradients_when_auto_borrows():
    """A compute-bound profile makes ``auto`` move experts even at these sizes."""
    cost = CostProfile(link_gbps=1e6, hbm_gbps=1e6, gemm_tflops=1e-6, group_us=1e-3, push_us=1e-3, tile_rows=1)
    plan = check_against_dense(small_config(ranks=4), 8, "one", "auto", "torch", cost=cost)
    assert (plan.slot_experts >= 0).any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("precision", ["fp32", "native"])
@pytest.mark.parametrize("activation", [swiglu, ClampedSwiGLU(limit=0.5)], ids=["swiglu", "clamped"])
def test_gradients_for_both_precisions_and_another_activation(backend, precision, activation):
    check_against_dense(small_config(), 5, "one", "exact", backend, precision=precision, activation=activation)


@pytest.mark.parametrize("biases", [True, False])
@pytest.mark.parametrize("routing, policy", [("one", "exact"), (1.0, "exact"), ("next", "none")])
def test_gradients_through_the_triton_kernels(routing, policy, biases):
    check_against_dense(small_config(), 3, routing, policy, "triton", biases=biases)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_never_read_the_unwritten_padding_rows(backend, monkeypatch):
    """Dispatch leaves padding rows unwritten: with every fresh float tensor full of NaN (the
    backward's shards and row gradients included), the gradients still equal the dense MoE's."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    plan = check_against_dense(small_config(ranks=4), 5, 1.0, "exact", backend, seed=4)
    assert int(plan.padding[..., 1].sum()) > 0  # there were padding rows to ignore


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_with_ragged_real_token_counts(backend):
    """A plan for fewer real tokens on some ranks: padded tokens get no output and no gradient."""
    check_against_dense(small_config(ranks=4), 6, "one", "exact", backend, counts=[6, 2, 0, 5])


@pytest.mark.parametrize("precision, combine_dtype", [("fp32", None), ("native", torch.float32)])
def test_bfloat16_gradients_are_close_to_fp64(precision, combine_dtype):
    config = small_config()
    group = init_group("local", ranks=2, device=DEVICE)
    ids, tensors = leaves(config, 6, "one", torch.bfloat16, biases=False)
    grad_out = torch.randn(2, 6, config.hidden, device=DEVICE)
    step = lambda x, topk_weights, w13, w2, b13, b2: ep_moe(  # noqa: E731
        x, ids, topk_weights, w13, w2, config=config, group=group, backend="torch", precision=precision,
        combine_dtype=combine_dtype)
    got = gradients(step, tensors, grad_out.bfloat16())
    fp64 = {name: None if t is None else t.detach().double().requires_grad_() for name, t in tensors.items()}
    expected = gradients(lambda **t: dense_reference(ids, **t), fp64, grad_out.double())
    for name in got:
        assert got[name].dtype == tensors[name].dtype
        assert relative_error(got[name], expected[name]) < 2e-2, name


def test_gradcheck_on_a_tiny_layer():
    """torch.autograd.gradcheck through dispatch, experts (with a borrowed one) and combine.

    The layer computes in fp32 by design (route weights, activations and combine sums), so an fp64
    gradcheck has no fp64 forward to difference: this one runs in fp32 with a step and tolerances
    sized for fp32 rounding; the tight checks are the fp64 comparisons above.
    """
    config = small_config(hidden=8, intermediate=4, capacity=3)
    group = init_group("local", ranks=2, device=DEVICE)
    ids, tensors = leaves(config, 3, "one", seed=3)
    assert (plan_step(ids, config, group).slot_experts >= 0).any()
    step = lambda x, topk_weights, w13, w2, b13, b2: ep_moe(  # noqa: E731
        x, ids, topk_weights, w13, w2, b13=b13, b2=b2, config=config, group=group, backend="torch")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not a double precision floating point.*")
        assert torch.autograd.gradcheck(step, tuple(tensors.values()), eps=1e-2, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_same_step_twice_gives_bit_identical_gradients(backend):
    config = small_config(ranks=4)
    group = init_group("local", ranks=4, device=DEVICE)
    ids, tensors = leaves(config, 5, "one")
    grad_out = torch.randn(4, 5, config.hidden, device=DEVICE)
    step = lambda x, topk_weights, w13, w2, b13, b2: ep_moe(  # noqa: E731
        x, ids, topk_weights, w13, w2, b13=b13, b2=b2, config=config, group=group, backend=backend)
    first, second = gradients(step, tensors, grad_out), gradients(step, tensors, grad_out)
    assert all(torch.equal(first[name], second[name]) for name in NAMES)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_with_grad_equals_the_inference_step_bit_for_bit(backend):
    config = small_config(ranks=4)
    group = init_group("local", ranks=4, device=DEVICE)
    ids, tensors = leaves(config, 5, "one")
    out = ep_moe(tensors["x"], ids, tensors["topk_weights"], tensors["w13"], tensors["w2"], b13=tensors["b13"],
                 b2=tensors["b2"], config=config, group=group, backend=backend)
    with torch.no_grad():
        expected = ep_moe(tensors["x"], ids, tensors["topk_weights"], tensors["w13"], tensors["w2"],
                          b13=tensors["b13"], b2=tensors["b2"], config=config, group=group, backend=backend)
    assert out.requires_grad and not expected.requires_grad
    assert torch.equal(out, expected)


def test_paths_without_a_backward_refuse_grad():
    """A pool holds copies of the weights (the caller's would get no gradient) and packed weights have no
    backward: with grad they raise, without it they run."""
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=32, capacity=8, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    ids, tensors = leaves(config, 4, 1.0, biases=False)
    x, weights = tensors["x"], tensors["topk_weights"]
    pool = ExpertPool.from_weights(tensors["w13"].detach(), tensors["w2"].detach(), config, group)
    with pytest.raises(NotImplementedError, match=r"no backward through a prebuilt pool= .* but x, topk_weights require"):
        ep_moe(x, ids, weights, group=group, pool=pool, backend="torch")
    plan = plan_step(ids, config, group)
    pushed = prefetch_experts(pool, plan, backend="torch")
    with pytest.raises(NotImplementedError, match=r"prebuilt pool= .* but x require"):
        ep_moe(x, ids, weights.detach(), group=group, pool=pool, plan=plan, pushed=pushed, backend="torch")
    with torch.no_grad():  # the prefetch is still there for the inference step
        ep_moe(x, ids, weights, group=group, pool=pool, plan=plan, pushed=pushed, backend="torch")
    pool.w2.requires_grad_()
    with pytest.raises(NotImplementedError, match=r"prebuilt pool= .* but pool.w2 require grad"):
        ep_moe(x.detach(), ids, weights.detach(), group=group, pool=pool, backend="torch")
    packed = [QuantizedTensor.quantize(tensors[name].detach(), "mxfp4") for name in ("w13", "w2")]
    with pytest.raises(NotImplementedError, match="no backward through mxfp4 expert weights, but x, topk_weights"):
        ep_moe(x, ids, weights, *packed, config=config, group=group, backend="torch")
    with torch.no_grad():
        assert torch.isfinite(ep_moe(x, ids, weights, *packed, config=config, group=group, backend="torch")).all()


@pytest.fixture
def one_process_collective_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = init_group(transport="collective", device="cpu")
    try:
        yield group
    finally:
        group.close()
        dist.destroy_process_group()


def test_collective_transport_trains_like_the_local_one(one_process_collective_group):
    """One process (R = 1): ep_moe and EPMoE (whose w13/w2 are the rank's E/R experts) give the local
    transport's gradients bit for bit (several processes: tests/transport/test_collective.py; the
    NVLink transport: tests/transport/test_nvlink_gpu.py)."""
    group = one_process_collective_group
    local = init_group("local", ranks=1, device="cpu")
    config = EPConfig(ranks=1, experts=2, top_k=2, hidden=16, intermediate=8, capacity=4, align=4)
    x, ids, weights, w13, w2 = make_inputs(config, 4, 1.0, torch.float32)
    per_rank = {}
    for name, grp, shape in (("collective", group, lambda t: t[0]), ("local", local, lambda t: t)):
        tensors = {"x": shape(x), "topk_weights": shape(weights), "w13": w13, "w2": w2}
        tensors = {key: t.clone().cpu().requires_grad_() for key, t in tensors.items()}
        out = ep_moe(tensors["x"], shape(ids).cpu(), tensors["topk_weights"], tensors["w13"], tensors["w2"],
                     config=config, group=grp, backend="torch")
        out.backward(torch.ones_like(out))
        per_rank[name] = {key: t.grad.reshape(t.grad.shape[-2:] if key in ("x", "topk_weights") else t.grad.shape)
                          for key, t in tensors.items()}
    for key, grad in per_rank["collective"].items():
        assert torch.equal(grad, per_rank["local"][key]), key
    layer = EPMoE(config, group, dtype=torch.float32, backend="torch")
    reference = EPMoE(config, local, dtype=torch.float32, backend="torch")
    reference.load_state_dict(layer.state_dict())
    layer(x[0].detach().cpu()).sum().backward()
    reference(x.detach().cpu()).sum().backward()
    for (name, parameter), twin in zip(layer.named_parameters(), reference.parameters()):
        assert torch.equal(parameter.grad, twin.grad), name


def dense_module(layer: EPMoE, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The same model as ``layer`` computed densely in fp64 from copies of its parameters: ``(out, parameters)``."""
    parameters = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    x = x.double()
    probabilities = torch.softmax(x @ parameters["router"].T, dim=-1)
    weights, ids = torch.topk(probabilities, layer.config.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = dense_reference(ids, x, weights, parameters["w13"], parameters["w2"])
    intermediate = parameters["shared_w2"].shape[-1]
    projected = x @ parameters["shared_w13"].T
    out = out + (F.silu(projected[..., :intermediate]) * projected[..., intermediate:]) @ parameters["shared_w2"].T
    return out, parameters


@pytest.mark.parametrize("policy", ["exact", "none"])
def test_module_gradients_equal_the_dense_model_and_sgd_lowers_the_loss(policy):
    config = small_config(ranks=4, capacity=6)
    group = init_group("local", ranks=4, device=DEVICE)
    torch.manual_seed(0)
    layer = EPMoE(config, group, policy=policy, shared_intermediate=8, dtype=torch.float32, backend="torch")
    x = torch.randn(4, 6, config.hidden, device=DEVICE)
    target = torch.randn(4, 6, config.hidden, device=DEVICE)
    loss = F.mse_loss(layer(x), target)
    loss.backward()
    dense_out, dense_parameters = dense_module(layer, x)
    F.mse_loss(dense_out, target.double()).backward()
    for name, parameter in layer.named_parameters():
        assert relative_error(parameter.grad, dense_parameters[name].grad) < 1e-5, name
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    losses = [loss.item()]
    for _ in range(4):
        optimizer.step()
        optimizer.zero_grad()
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        losses.append(loss.item())
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    with torch.no_grad():  # inference after training uses the pool, rebuilt from the trained weights
        assert torch.allclose(layer(x), dense_module(layer, x)[0].float(), atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_later_step_before_the_backward_leaves_its_gradients_intact(backend):
    """Step A's forward, then step B's (other inputs, other routing, the same group), then A's backward:
    A's gradients equal those of A alone, bit for bit (the backward keeps its own rows, not the
    group's shared receive buffers, which B overwrote)."""
    config = small_config(ranks=4)
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    ids_a, tensors_a = leaves(config, 6, "one", seed=1)
    ids_b, tensors_b = leaves(config, 6, 3.0, seed=2)

    def step(ids, tensors):
        return ep_moe(tensors["x"], ids, tensors["topk_weights"], tensors["w13"], tensors["w2"], b13=tensors["b13"],
                      b2=tensors["b2"], config=config, group=group, policy="exact", backend=backend)

    grad_out = torch.randn(config.ranks, 6, config.hidden, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    names = list(tensors_a)
    alone = torch.autograd.grad(step(ids_a, tensors_a), [tensors_a[n] for n in names], grad_out)
    out_a = step(ids_a, tensors_a)
    step(ids_b, tensors_b).sum().backward()  # B runs forward and backward in between
    interleaved = torch.autograd.grad(out_a, [tensors_a[n] for n in names], grad_out)
    for name, first, second in zip(names, alone, interleaved):
        assert torch.equal(first, second), name


def test_activation_checkpointing_recomputes_the_step():
    """torch.utils.checkpoint around the step: the forward keeps nothing of it, the backward replans
    nothing new (same ids), and the gradients equal the plain backward's bit for bit."""
    from torch.utils.checkpoint import checkpoint

    config = small_config(ranks=4)
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    ids, tensors = leaves(config, 5, "next", seed=4)
    names = list(tensors)

    def step(x, topk_weights, w13, w2, b13, b2):
        return ep_moe(x, ids, topk_weights, w13, w2, b13=b13, b2=b2, config=config, group=group, policy="exact",
                      backend="torch")

    grad_out = torch.randn(config.ranks, 5, config.hidden, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    plain = torch.autograd.grad(step(**tensors), [tensors[n] for n in names], grad_out)
    recomputed = checkpoint(step, *(tensors[n] for n in names), use_reentrant=False)
    again = torch.autograd.grad(recomputed, [tensors[n] for n in names], grad_out)
    for name, first, second in zip(names, plain, again):
        assert torch.equal(first, second), name


def _poison_rows_outside_groups(monkeypatch):
    """Make every dispatched shard row that holds no entry (group padding, rows outside every group) NaN,
    in the forward's rows and route weights and in the backward's output-gradient rows."""
    import flatep.backward as backward

    scatter = backward._scatter

    def poisoned(rows, route_weights, context):
        shard, shard_weights, links = scatter(rows, route_weights, context)
        for local_index, rank in enumerate(context.group.local_ranks):
            real = torch.cat([backward._real_rows(context, rank, part, first, end)
                              for part, first, end in context.parts()])
            if context.plan.slot_base:  # rows between the home groups and slot_base are in no part's groups
                assert real.shape[0] == context.plan.shard_rows
            shard[local_index][~real] = float("nan")
            shard_weights[local_index][~real] = float("nan")
        return shard, shard_weights, links

    monkeypatch.setattr(backward, "_scatter", poisoned)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("policy", ["exact", "none"])
def test_rows_without_entries_add_nothing_even_when_they_hold_nan(monkeypatch, backend, policy):
    """Dispatch need not zero the padding rows: the backward masks rows by the plan's row counts, so NaN
    there changes no gradient (align=4 pads most groups)."""
    _poison_rows_outside_groups(monkeypatch)
    check_against_dense(small_config(ranks=4), 5, "one", policy, backend, seed=7)


def test_the_backward_reads_nothing_back_to_the_host(monkeypatch):
    """CPU: no tensor is read on the host (item, tolist, cpu, numpy, bool/int/float conversion) anywhere in
    the backward of a step that borrows experts. On CUDA: torch.cuda.set_sync_debug_mode (tests/test_layer_gpu.py)."""
    config = small_config(ranks=4)
    group = init_group("local", ranks=4, device=DEVICE)
    ids, tensors = leaves(config, 6, "one", seed=5)
    out = ep_moe(tensors["x"], ids, tensors["topk_weights"], tensors["w13"], tensors["w2"], b13=tensors["b13"],
                 b2=tensors["b2"], config=config, group=group, policy="exact", backend="torch")
    assert (plan_step(ids, config, group).slot_experts >= 0).any()

    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"the backward read a tensor on the host (Tensor.{name})")
        return read

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    grads = torch.autograd.grad(out, list(tensors.values()), torch.ones_like(out))
    monkeypatch.undo()
    assert all(torch.isfinite(grad).all() for grad in grads)


def saved_activation_bytes(config: EPConfig, tokens: int, policy: str) -> tuple[int, int]:
    """``(bytes, shard_rows)`` of one step: the bytes of every tensor autograd keeps for the backward
    (``torch.autograd.graph.saved_tensors_hooks``) that is not a view of the step's weights (those are
    references, not copies), and the plan's shard rows per rank."""
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    ids, tensors = leaves(config, tokens, 2.0, biases=False, seed=5)
    weights = {tensors[name].untyped_storage().data_ptr() for name in ("w13", "w2")}
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in weights:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    plan = plan_step(ids, config, group, policy)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = ep_moe(tensors["x"], ids, tensors["topk_weights"], tensors["w13"], tensors["w2"], config=config,
                     group=group, policy=policy, plan=plan, backend="torch")
    out.sum().backward()  # the saved tensors serve their backward
    return sum(saved), plan.shard_rows


@pytest.mark.parametrize("experts", [32, 128])
@pytest.mark.parametrize("policy", ["exact", "none"])
def test_what_the_forward_saves_is_its_shard_rows(policy, experts):
    """Besides references to the weights, a step keeps exactly its dispatched rows, their fp32 route
    weights and their int32 links: ``R * rows * (H * itemsize + 4 + 8)`` bytes, ``rows`` = the plan's
    shard rows (set by ``s``, ``K`` and the groups' padding room), nothing of size ``E x H`` or
    ``E x I``: the gate/up projection and the activation are recomputed in the backward."""
    config = EPConfig(ranks=4, experts=experts, top_k=2, hidden=64, intermediate=32, capacity=16)
    saved, rows = saved_activation_bytes(config, 12, policy)
    assert saved == config.ranks * rows * (config.hidden * 4 + 4 + 2 * 4), (saved, rows)
