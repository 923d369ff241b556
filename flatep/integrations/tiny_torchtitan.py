"""Tiny randomly initialised torchtitan Qwen3-MoE models, synthetic data and a plain training loop
that run on a CPU (for tests, examples and docs).

The model is torchtitan's own ``Qwen3Model`` (softmax router with renormalised top-k, routed
``GroupedExperts``, no shared experts), built from its configuration classes with small sizes. Two
choices differ from torchtitan's shipped flavours, both so that it trains on a CPU:

- attention is torchtitan's ``ScaledDotProductAttention`` (causal, one document per sequence):
  the shipped flavours use FlexAttention or varlen attention, and FlexAttention has no backward
  on a CPU;
- the MoE load-balancing coefficient is left out (no ``expert_bias_E``): its update is an
  optimizer hook of torchtitan's trainer, and a plain training loop would not run it.

With ``bf16_experts=False`` the routed experts are :class:`ModelDtypeGroupedExperts`: torchtitan's
``GroupedExperts`` computing in the model's dtype instead of bfloat16, the fp32 reference that FlatEP
with ``expert_dtype=None`` is compared with.

This module imports torchtitan (``pip install flatep[torchtitan]``); ``import flatep`` does not import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import (
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock


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


class ModelDtypeGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` without its casts to bfloat16: the same grouped GEMMs
    (``torch._grouped_mm``) and SiLU gate, in the dtype of the tokens and weights.

    ``forward(x_RD [R, D], num_tokens_per_expert_E [E]) -> [R, D]`` in ``x_RD``'s dtype; the
    parameters (names, shapes, initialisation) are ``GroupedExperts``'.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        if x_RD.is_cuda and x_RD.dtype != torch.bfloat16:
            return self._per_expert(x_RD, num_tokens_per_expert_E)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate_RF = torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offsets_E)
        up_RF = torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offsets_E)
        return torch._grouped_mm(F.silu(gate_RF) * up_RF, self.w2_EDF.transpose(-2, -1), offs=offsets_E)

    def _per_expert(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """The same products as one matmul per expert: CUDA's grouped GEMM takes bfloat16 only.

        Reads the group sizes back to the host (a synchronisation): this module is a reference.
        """
        outputs = []
        for expert, rows in enumerate(x_RD.split(num_tokens_per_expert_E.tolist())):
            gate = rows @ self.w1_EFD[expert].transpose(-2, -1)
            up = rows @ self.w3_EFD[expert].transpose(-2, -1)
            outputs.append((F.silu(gate) * up) @ self.w2_EDF[expert].transpose(-2, -1))
        return torch.cat(outputs)


def tiny_qwen3_moe(sizes: TinyQwen3MoE = TinyQwen3MoE(), seed: int = 0, bf16_experts: bool = True) -> nn.Module:
    """A torchtitan ``Qwen3Model`` of ``sizes``, initialised by torchtitan's own ``init_states`` from ``seed``.

    fp32 parameters on the CPU. Call it as ``model(tokens [B, L] int64) -> logits [B, L, vocab] fp32``
    (no positions, no masks: causal attention over each sequence). The same ``seed`` gives the same
    weights, whatever ``bf16_experts``, so two calls give two identical models (one to switch to
    FlatEP, one to compare with).

    Args:
        bf16_experts: torchtitan's ``GroupedExperts`` (GEMMs in bfloat16), or with ``False``
            :class:`ModelDtypeGroupedExperts` (GEMMs in fp32).
    """
    # Qwen3's initialisation: normal(0.02) weights, the residual outputs scaled down with depth.
    linear_init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    residual_std = 0.02 / (2 * sizes.layers) ** 0.5
    residual_init = {"weight": partial(nn.init.normal_, std=residual_std), "bias": nn.init.zeros_}
    experts_init = {"w1_EFD": linear_init["weight"], "w3_EFD": linear_init["weight"],
                    "w2_EDF": partial(nn.init.normal_, std=residual_std)}

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=width, eps=1e-6, param_init={"weight": nn.init.ones_})

    routed_experts = make_routed_experts_config(
        dim=sizes.dim, hidden_dim=sizes.moe_hidden, num_experts=sizes.experts, top_k=sizes.top_k,
        param_init=experts_init, comm_backend="standard",
    )
    if not bf16_experts:
        routed_experts.inner_experts = ModelDtypeGroupedExperts.Config(
            dim=sizes.dim, hidden_dim=sizes.moe_hidden, num_experts=sizes.experts, param_init=experts_init,
        )
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
                routed_experts=routed_experts,
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


def markov_batches(steps: int, batch: int, length: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches ``[batch, length]`` int64 of a fixed random Markov chain over ``vocab`` tokens.

    Each token is followed by one of 4 successors drawn for it from ``seed``, so a model can learn
    the data (its loss falls from ``log(vocab)`` towards ``log(4)``), unlike uniform random tokens.
    The same arguments give the same batches.
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=generator)
    tokens = torch.empty(steps * batch, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=generator)
    for position in range(1, length):
        choice = torch.randint(0, 4, (steps * batch,), generator=generator)
        tokens[:, position] = successors[tokens[:, position - 1], choice]
    return list(tokens.split(batch))


def train(model: nn.Module, batches: Iterable[torch.Tensor], lr: float = 3e-3) -> list[float]:
    """Train ``model`` on ``batches`` (next-token cross-entropy, AdamW, one step per batch); the losses, fp32.

    A plain loop (torchtitan's ``Trainer`` wants a job config, a tokenizer and a dataset): forward
    ``model(tokens) -> logits [B, L, vocab]``, loss over positions ``[0, L-1)`` predicting ``[1, L)``,
    backward, ``torch.optim.AdamW`` step (single-tensor updates, ``foreach=False``, so two runs of
    equal gradients take equal steps).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
    losses = []
    model.train()
    for tokens in batches:
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
