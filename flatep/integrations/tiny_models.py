"""Tiny randomly initialised MoE language models of the families :func:`flatep.integrations.transformers.shard_moe`
supports, built from their transformers configs (no downloads).

The shapes are small but every routing feature of the real model is present: Qwen3-MoE's
renormalised softmax top-k, DeepSeek-V3's grouped top-k with score-correction bias and routed
scaling (and its dense first layer and shared expert), Kimi-K2's single-group variant with its
scaling factor, gpt-oss's top-4 with router and expert biases, clamped SwiGLU and sliding-window
layers. Parameters that the models initialise to zero (expert biases, score-correction bias) are
drawn at random so that they take part, and the initialiser's scale is raised so that the experts,
not the residual stream alone, decide the next token.
"""
from __future__ import annotations

import torch
import torch.nn as nn

TINY_FAMILIES = ("qwen3-moe", "deepseek-v3", "kimi-k2", "gpt-oss")

_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=512, initializer_range=0.125)


def tiny_config(family: str, **overrides: object):
    """The transformers config of a tiny model of ``family`` (one of :data:`TINY_FAMILIES`).

    Sizes: vocabulary 128, hidden 64, 4 heads; Qwen3-MoE 2 layers, 8 experts, top-2 (renormalised);
    DeepSeek-V3 3 layers (the first dense), 16 experts in 4 groups, top-4 from 2 groups, scaling
    2.5, one shared expert; Kimi-K2 the same with one group and scaling 2.827; gpt-oss 2 layers
    (sliding then full attention), 8 experts, top-4. ``overrides`` replace any config field.
    """
    if family == "qwen3-moe":
        from transformers import Qwen3MoeConfig

        fields = dict(
            _COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        )
        return Qwen3MoeConfig(**{**fields, **overrides})
    if family in ("deepseek-v3", "kimi-k2"):
        from transformers import DeepseekV3Config

        groups = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5) if family == "deepseek-v3" else dict(
            n_group=1, topk_group=1, routed_scaling_factor=2.827
        )
        fields = dict(
            _COMMON, num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
            norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, **groups,
        )
        return DeepseekV3Config(**{**fields, **overrides})
    if family == "gpt-oss":
        from transformers import GptOssConfig

        fields = dict(
            _COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=32,
            num_local_experts=8, num_experts_per_tok=4, sliding_window=8,
            # gpt-oss's YaRN stretches 4096 positions 32 times; keep its RoPE as released.
            max_position_embeddings=131072,
        )
        return GptOssConfig(**{**fields, **overrides})
    raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}")


@torch.no_grad()
def tiny_model(
    family: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    **overrides: object,
) -> nn.Module:
    """A tiny ``*ForCausalLM`` of ``family`` with random weights, in eval mode.

    Weights are drawn on the CPU in fp32 from ``seed`` and then cast, so a model of the same seed is
    the same model on every device and in every dtype (up to the cast).

    Args:
        family: one of :data:`TINY_FAMILIES`.
        dtype: bfloat16 or float32. As when a checkpoint is loaded, DeepSeek-V3's router stays fp32.
        device: where the model goes.
        seed: the random seed of the weights.
        overrides: config fields, see :func:`tiny_config`.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
        for name, parameter in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                parameter.normal_(0.0, config.initializer_range)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(device=device, dtype=dtype).eval()
    for name, module in model.named_modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            module.float()
    return model
