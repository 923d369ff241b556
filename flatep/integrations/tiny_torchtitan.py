"""Tiny randomly initialised torchtitan Qwen3-MoE models that train on a CPU (for tests, examples and docs).

The model is torchtitan's own ``Qwen3Model`` (softmax router with renormalised top-k, routed
``GroupedExperts``, no shared experts), built from its configuration classes with small sizes. Two
choices differ from torchtitan's shipped flavours, both so that it trains on a CPU:

- attention is torchtitan's ``ScaledDotProductAttention`` (causal, one document per sequence):
  the shipped flavours use FlexAttention or varlen attention, and FlexAttention has no backward
  on a CPU;
- the MoE load-balancing coefficient is left out (no ``expert_bias_E``): its update is an
  optimizer hook of torchtitan's trainer, and a plain training loop would not run it.

torchtitan is imported only inside this module (``pip install flatep[torchtitan]``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn


@dataclass(frozen=True)
class TinyQwen3MoE:
    """Sizes of a tiny Qwen3-MoE model.

    Attributes:
        layers: transformer blocks, every one with an MoE feed-forward.
        dim: model width ``D`` (a multiple of 8: torch's CPU grouped GEMM wants 16-byte bf16 rows).
        heads, kv_heads, head_dim: grouped-query attention.
        moe_hidden: each routed expert's intermediate width ``F`` (a multiple of 8, as ``dim``).
        experts, top_k: ``E`` routed experts, ``K`` of them per token.
        vocab: vocabulary size.
        max_seq_len: longest sequence the rotary embedding covers.
    """

    layers: int = 2
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    moe_hidden: int = 32
    experts: int = 8
    top_k: int = 2
    vocab: int = 256
    max_seq_len: int = 256


def tiny_qwen3_moe(sizes: TinyQwen3MoE = TinyQwen3MoE(), seed: int = 0) -> nn.Module:
    """A torchtitan ``Qwen3Model`` of ``sizes``, initialised by torchtitan's own ``init_states`` from ``seed``.

    fp32 parameters on the CPU. Call it as ``model(tokens [B, L] int64) -> logits [B, L, vocab] fp32``
    (no positions, no masks: causal attention over each sequence). The same ``seed`` gives the same
    weights, so two calls give two identical models (one to switch to FlatEP, one to compare with).
    """
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    # Qwen3's initialisation: normal(0.02) weights, the residual outputs scaled down with depth.
    linear_init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    residual_std = 0.02 / (2 * sizes.layers) ** 0.5
    residual_init = {"weight": partial(nn.init.normal_, std=residual_std), "bias": nn.init.zeros_}
    experts_init = {"w1_EFD": linear_init["weight"], "w3_EFD": linear_init["weight"],
                    "w2_EDF": partial(nn.init.normal_, std=residual_std)}

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=width, eps=1e-6, param_init={"weight": nn.init.ones_})

    rope = CosSinRoPE.Config(dim=sizes.head_dim, max_seq_len=sizes.max_seq_len, theta=1_000_000.0)
    blocks = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(sizes.dim),
            ffn_norm=norm(sizes.dim),
            attention=make_gqa_config(
                dim=sizes.dim, n_heads=sizes.heads, n_kv_heads=sizes.kv_heads, head_dim=sizes.head_dim,
                wqkv_param_init=linear_init, wo_param_init=residual_init,
                inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True, rope=rope,
                qk_norm=norm(sizes.head_dim),
            ),
            moe=make_moe_config(
                num_experts=sizes.experts,
                load_balance_coeff=None,
                router=make_router_config(
                    dim=sizes.dim, num_experts=sizes.experts, gate_param_init=linear_init, top_k=sizes.top_k,
                    score_func="softmax", route_norm=True,
                ),
                routed_experts=make_routed_experts_config(
                    dim=sizes.dim, hidden_dim=sizes.moe_hidden, num_experts=sizes.experts, top_k=sizes.top_k,
                    param_init=experts_init, comm_backend="standard",
                ),
            ),
        )
        for _ in range(sizes.layers)
    ]
    config = Qwen3Model.Config(
        vocab_size=sizes.vocab,
        dim=sizes.dim,
        norm=norm(sizes.dim),
        tok_embeddings=Embedding.Config(num_embeddings=sizes.vocab, embedding_dim=sizes.dim,
                                        param_init={"weight": partial(nn.init.normal_, std=0.02)}),
        lm_head=Linear.Config(in_features=sizes.dim, out_features=sizes.vocab, param_init=linear_init),
        layers=blocks,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = config.build()
        model.init_states()
    return model
