"""Tiny transformers MoE models sharded with FlatEP generate exactly the unsharded model's greedy tokens.

Virtual ranks on the CPU in fp32, every family (Qwen3-MoE, DeepSeek-V3, Kimi-K2, gpt-oss), R = 2 and
4, both policies. The models are built from their configs (no downloads).
"""
from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers")

from flatep import init_group  # noqa: E402
from flatep.integrations.tiny_models import TINY_FAMILIES, tiny_model  # noqa: E402
from flatep.integrations.transformers import FlatEPExperts, shard_moe, sharded_experts  # noqa: E402

NEW_TOKENS = 32
# Three prompts of 11 tokens: prefill (T = 33) and decode (T = 3) both leave ranks with padding,
# and at R = 4 one rank has no token at all while decoding.
PROMPTS = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(7))


def greedy(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequences [B, 11 + 32], logits [B, 32, V])`` of greedy decoding with the KV cache."""
    with torch.no_grad():
        out = model.generate(
            PROMPTS, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, 1)


@functools.cache
def unsharded(family: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unsharded model's greedy sequences, their step logits and a full forward's logits."""
    model = tiny_model(family, dtype=dtype)
    sequences, logits = greedy(model)
    with torch.no_grad():
        full = model(sequences).logits
    return sequences, logits, full


def sparse_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if hasattr(module, "experts") and not isinstance(module, FlatEPExperts)]


@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_sharded_model_generates_the_unsharded_tokens(family, ranks, policy):
    expected_sequences, expected_logits, expected_full = unsharded(family)
    model = tiny_model(family)
    routers = [getattr(block, "gate", None) or block.router for block in sparse_blocks(model)]
    # A small capacity that the prefill must grow.
    summary = shard_moe(model, init_group("local", ranks=ranks, device="cpu"), policy, capacity=4, backend="torch",
                        record_routing=True)
    assert [getattr(block, "gate", None) or block.router for block in sparse_blocks(model)] == routers
    sequences, logits = greedy(model)
    assert torch.equal(sequences, expected_sequences)
    scale = expected_logits.abs().max()
    assert (logits - expected_logits).abs().max() <= 1e-5 * scale
    with torch.no_grad():
        full = model(sequences).logits
    assert (full - expected_full).abs().max() <= 1e-5 * scale

    layers = sharded_experts(model)
    assert [name for name, _ in layers] == list(summary.layers) and layers
    for _, experts in layers:
        calls = NEW_TOKENS + 1  # the prefill, 31 decode steps, the full forward
        assert len(experts.maxvio()) == calls and all(value >= 0 for value in experts.maxvio())
        rows = torch.stack(experts.received)
        assert rows.shape == (calls, ranks)
        assert rows.sum(1).tolist() == [t * experts.config.top_k for t in [33] + [3] * (NEW_TOKENS - 1) + [129]]
        if policy == "exact":  # flat: every rank computes floor or ceil of T*K/R rows
            assert (rows.max(1).values - rows.min(1).values).max() <= 1


@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss", "deepseek-v3", "kimi-k2"])
def test_bf16_native_precision_reproduces_the_unsharded_model_bit_for_bit(family):
    """``precision="native"`` rounds as transformers' experts do (CPU GEMMs): bf16 route weights give
    bf16 rows; fp32 route weights (DeepSeek-V3, Kimi-K2) give fp32 rows rounded once after combine."""
    expected_sequences, expected_logits, expected_full = unsharded(family, torch.bfloat16)
    model = tiny_model(family, dtype=torch.bfloat16)
    shard_moe(model, init_group("local", ranks=4, device="cpu"), backend="torch")
    sequences, logits = greedy(model)
    assert torch.equal(sequences, expected_sequences) and torch.equal(logits, expected_logits)
    with torch.no_grad():
        assert torch.equal(model(sequences).logits, expected_full)


@pytest.mark.parametrize("family", ["deepseek-v3", "gpt-oss"])
def test_fp32_precision_generates_the_unsharded_tokens(family):
    expected_sequences, expected_logits, _ = unsharded(family)
    model = tiny_model(family)
    shard_moe(model, init_group("local", ranks=4, device="cpu"), backend="torch", precision="fp32")
    sequences, logits = greedy(model)
    assert torch.equal(sequences, expected_sequences)
    assert (logits - expected_logits).abs().max() <= 1e-5 * expected_logits.abs().max()


@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_experts_module_equals_the_original_on_the_routers_choice(family, precision):
    model = tiny_model(family)
    block = sparse_blocks(model)[-1]
    router = getattr(block, "gate", None) or block.router
    hidden = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, weights, ids = router(hidden)
        expected = block.experts(hidden, ids, weights)
        shard_moe(model, init_group("local", ranks=4, device="cpu"), backend="torch", precision=precision)
        out = block.experts(hidden, ids, weights)
    assert isinstance(block.experts, FlatEPExperts)
    assert out.dtype == expected.dtype
    assert (out - expected).norm() <= 1e-5 * expected.norm()


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_keeps_only_its_experts_and_the_originals_are_released(ranks):
    model = tiny_model("gpt-oss")
    originals = [weakref.ref(p) for name, p in model.named_parameters() if ".experts." in name]
    assert originals
    summary = shard_moe(model, init_group("local", ranks=ranks, device="cpu"), backend="torch")
    gc.collect()
    assert all(ref() is None for ref in originals)
    assert not any(".experts." in name for name, _ in model.named_parameters())
    # Per rank: epn home experts of each of the L layers + one set of epn slots that all layers
    # share, biases included: (L+1)/(L*R) of before.
    layers = len(summary.layers)
    assert layers >= 2
    assert summary.bytes_after * ranks * layers == summary.bytes_before * (layers + 1)
    assert f"{summary.experts} experts per layer -> {summary.experts_per_rank} home per layer" in str(summary)


def test_unsupported_family_is_named():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with pytest.raises(ValueError, match=r"supports Qwen3-MoE .*gpt-oss.*got MixtralForCausalLM"):
        shard_moe(MixtralForCausalLM(config), init_group("local", ranks=2, device="cpu"))


def test_ranks_must_divide_the_experts():
    with pytest.raises(ValueError, match="divisible by ranks"):
        shard_moe(tiny_model("qwen3-moe"), init_group("local", ranks=3, device="cpu"))


def test_unexpected_experts_module_is_refused():
    model = tiny_model("qwen3-moe")
    sparse_blocks(model)[0].experts = torch.nn.Linear(2, 2)  # as a quantized checkpoint's experts would be
    with pytest.raises(ValueError, match=r"not Qwen3MoeExperts .*dequantized.*layers\.0\.mlp\.experts \(Linear\)"):
        shard_moe(model, init_group("local", ranks=2, device="cpu"))


def test_fixed_capacity_is_for_the_per_process_transports():
    with pytest.raises(ValueError, match="fixed_capacity is for the per-process transports"):
        shard_moe(tiny_model("qwen3-moe"), init_group("local", ranks=2, device="cpu"), fixed_capacity=True)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        shard_moe(tiny_model("qwen3-moe"), init_group("local", ranks=2, device="cpu"), precision="fp16")


def test_tolerance_keeps_the_tokens_and_skips_mild_rebalancing():
    """With a tolerance above the routers' rank imbalance no call borrows, and greedy tokens still match."""
    expected_sequences, _, _ = unsharded("qwen3-moe")
    model = tiny_model("qwen3-moe")
    shard_moe(model, init_group("local", ranks=2, device="cpu"), "exact", tolerance=1.0, backend="torch",
              record_routing=True)
    sequences, _ = greedy(model)
    assert torch.equal(sequences, expected_sequences)
    for _, experts in sharded_experts(model):
        assert experts.config.tolerance == 1.0
        # R = 2: the busiest rank has at most every row, i.e. (1 + 1.0) x the mean, so nothing moves.
        assert experts.rank_imbalance() == experts.rank_imbalance(classic=True)


@pytest.mark.parametrize("family", ["kimi-k2", "gpt-oss"])
def test_fp8_dispatch_equals_the_original_experts_on_the_quantized_tokens(family):
    """``shard_moe(..., dispatch_dtype=torch.float8_e4m3fn)``: each experts call equals the original
    module's on the tokens as fp8 dispatch delivers them (quantized per 128 columns, dequantized)."""
    from flatep.kernels.fp8_rows import pack_rows_torch, unpack_rows_torch

    model = tiny_model(family)
    block = sparse_blocks(model)[-1]
    router = getattr(block, "gate", None) or block.router
    hidden = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    seen = unpack_rows_torch(pack_rows_torch(hidden), hidden.shape[-1], hidden.dtype)
    with torch.no_grad():
        _, weights, ids = router(hidden)
        expected, unquantized = block.experts(seen, ids, weights), block.experts(hidden, ids, weights)
        shard_moe(model, init_group("local", ranks=4, device="cpu"), backend="torch",
                  dispatch_dtype=torch.float8_e4m3fn)
        out = block.experts(hidden, ids, weights)
    assert block.experts.dispatch_dtype == torch.float8_e4m3fn
    assert (out - expected).norm() <= 1e-5 * expected.norm()
    assert (out - unquantized).norm() > 1e-3 * unquantized.norm()  # the tokens were quantized


def test_a_bad_dispatch_dtype_is_refused_before_any_layer_changes():
    model = tiny_model("qwen3-moe")
    with pytest.raises(ValueError, match="dispatch_dtype must be None"):
        shard_moe(model, init_group("local", ranks=2, device="cpu"), dispatch_dtype=torch.float16)
    assert not sharded_experts(model)


@pytest.mark.parametrize("fp8_activations", [None, True])
def test_gpt_oss_loaded_dequantized_keeps_its_experts_in_mxfp4_exactly(fp8_activations):
    """transformers dequantizes gpt-oss's MXFP4 checkpoint where its MXFP4 kernels do not run (the
    CPU): ``weights="mxfp4"`` packs the bf16 values back, exactly (they came from MXFP4), and the
    model generates the same tokens; with ``fp8_activations`` the pools hold the ``mma`` layout."""
    from flatep.quant import QuantizedTensor

    model = tiny_model("gpt-oss")
    with torch.no_grad():
        for block in sparse_blocks(model):
            for name in ("gate_up_proj", "down_proj"):  # [E, in, out]: MXFP4 blocks run along the input dimension
                weight = getattr(block.experts, name)
                weight.copy_(QuantizedTensor.quantize(weight.transpose(1, 2), "mxfp4").dequantize().transpose(1, 2))
    expected_sequences, expected_logits = greedy(model)
    originals = [(block.experts.gate_up_proj.clone(), block.experts.down_proj.clone()) for block in sparse_blocks(model)]
    shard_moe(model, init_group("local", ranks=2, device="cpu"), backend="torch", weights="mxfp4",
              fp8_activations=fp8_activations)
    layers = sharded_experts(model)
    for (_, experts), (gate_up, down) in zip(layers, originals):
        pool = experts.pool
        assert pool.weights == "mxfp4" and pool.w13.dtype == torch.uint8
        assert pool.layout == ("mma" if fp8_activations else "words")
        w13 = QuantizedTensor("mxfp4", pool.w13.flatten(0, 1), pool.w13_scale.flatten(0, 1), pool.layout).dequantize()
        w2 = QuantizedTensor("mxfp4", pool.w2.flatten(0, 1), pool.w2_scale.flatten(0, 1), pool.layout).dequantize()
        gate_up = gate_up.transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
        assert torch.equal(w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
        assert torch.equal(w2, down.transpose(1, 2))
        assert "weights='mxfp4'" in experts.extra_repr()
    sequences, logits = greedy(model)
    assert torch.equal(sequences, expected_sequences)
    assert (logits - expected_logits).abs().max() <= 1e-5 * expected_logits.abs().max()


def fp8_experts_like(experts: torch.nn.Module, config) -> torch.nn.Module:
    """transformers' ``FP8Experts`` holding ``experts``' weights in fp8 128x128 blocks, as
    ``FineGrainedFP8Config`` loads a DeepSeek-V3 checkpoint on a GPU (built here on the CPU)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    from flatep.quant import QuantizedTensor

    module = FP8Experts(config, block_size=(128, 128))
    for name in ("gate_up_proj", "down_proj"):
        packed = QuantizedTensor.quantize(getattr(experts, name).detach(), "fp8")
        getattr(module, name).data = packed.values
        getattr(module, f"{name}_scale_inv").data = packed.scales
    return module


def test_fp8_experts_that_transformers_loaded_stay_in_fp8():
    """Kimi-K2 with transformers' fp8 experts modules (what its FP8 checkpoint loads into on a GPU):
    the pools hold the same fp8 values and scales, and the layer computes the fp8 experts' function."""
    from flatep import dense_moe
    from flatep.quant import QuantizedTensor

    model = tiny_model("kimi-k2", dtype=torch.bfloat16, hidden_size=128, moe_intermediate_size=128)
    block = sparse_blocks(model)[-1]
    router = block.gate
    hidden = torch.randn(37, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    for sparse in sparse_blocks(model):
        sparse.experts = fp8_experts_like(sparse.experts, model.config)
    modules = [sparse.experts for sparse in sparse_blocks(model)]
    with torch.no_grad():
        _, weights, ids = router(hidden)
        shard_moe(model, init_group("local", ranks=4, device="cpu"), backend="torch", capacity=64)
        out = block.experts(hidden, ids, weights)
    for (_, experts), module in zip(sharded_experts(model), modules):
        assert experts.pool.weights == "fp8" and experts.pool.dtype == torch.bfloat16
        assert torch.equal(experts.pool.w13.flatten(0, 1).view(torch.uint8), module.gate_up_proj.view(torch.uint8))
        assert torch.equal(experts.pool.w2_scale.flatten(0, 1), module.down_proj_scale_inv)
    last = modules[-1]
    w13 = QuantizedTensor("fp8", last.gate_up_proj, last.gate_up_proj_scale_inv).dequantize()
    w2 = QuantizedTensor("fp8", last.down_proj, last.down_proj_scale_inv).dequantize()
    reference = dense_moe(hidden.unsqueeze(0), ids.unsqueeze(0).int(), weights.unsqueeze(0).float(), w13, w2)[0]
    # fp8 experts also quantize their activations (per token, per 128 columns): e4m3's error.
    assert (out.float() - reference).norm() <= 6e-2 * reference.norm()


def test_weights_that_do_not_fit_the_experts_are_refused():
    model = tiny_model("kimi-k2", hidden_size=128, moe_intermediate_size=128)
    for sparse in sparse_blocks(model):
        sparse.experts = fp8_experts_like(sparse.experts, model.config)
    with pytest.raises(ValueError, match="these experts are fp8 .*FineGrainedFP8Config\\(dequantize=True\\)"):
        shard_moe(model, init_group("local", ranks=2, device="cpu"), weights="mxfp4")
    with pytest.raises(ValueError, match="weights='fp8' does not fit these experts"):
        shard_moe(tiny_model("qwen3-moe"), init_group("local", ranks=2, device="cpu"), weights="fp8")  # H = 64
    with pytest.raises(ValueError, match="weights \\(the weight format\\) must be one of"):
        shard_moe(tiny_model("qwen3-moe"), init_group("local", ranks=2, device="cpu"), weights="int4")
    with pytest.raises(ValueError, match="fp8_activations .* applies to mxfp4 weights, got bf16"):
        shard_moe(tiny_model("qwen3-moe"), init_group("local", ranks=2, device="cpu"), fp8_activations=True)
