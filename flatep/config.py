"""EPConfig: the numbers that size an expert-parallel group, and presets for real models."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

POLICIES = ("exact", "none")


def align_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= value``."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class EPConfig:
    """Sizes of one expert-parallel group.

    Attributes:
        ranks: EP ranks ``R``.
        experts: routed experts ``E``; rank ``r`` owns ``[r*epn, (r+1)*epn)``.
        top_k: experts per token ``K``.
        hidden: hidden size ``H`` of a token row.
        intermediate: expert intermediate size ``I`` (``w13`` is ``[E, 2I, H]``, ``w2`` is ``[E, H, I]``).
        capacity: token capacity per rank ``S``; a step passes ``1 <= s <= S`` tokens.
        align: every non-empty expert group of a shard is padded to a multiple of this.
    """

    ranks: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    capacity: int
    align: int = 128

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EPConfig.{field.name} must be a positive integer, got {value!r}")
        if self.experts % self.ranks:
            raise ValueError(
                f"EPConfig.experts must be divisible by ranks ({self.ranks}), got {self.experts}"
            )
        if self.top_k > self.experts:
            raise ValueError(f"EPConfig.top_k must be <= experts ({self.experts}), got {self.top_k}")

    @property
    def experts_per_rank(self) -> int:
        """``epn = E / R``: home experts of each rank, also the borrow slots per rank."""
        return self.experts // self.ranks

    @property
    def groups(self) -> int:
        """Expert groups per shard: ``2*epn`` (home experts, then slots)."""
        return 2 * self.experts_per_rank

    def shard_rows(self, policy: str = "exact") -> int:
        """Rows of one rank's receive shard at full capacity.

        ``exact``: ``NvS = align_up(S*K + (align-1)*2*epn, align)``.
        ``none`` (classic EP): a rank may receive every entry of the group,
        ``align_up(R*S*K + (align-1)*epn, align)``.
        """
        return self.step_rows(self.ranks * self.capacity, policy)

    def step_rows(self, total_tokens: int, policy: str = "exact") -> int:
        """Rows a step with ``total_tokens`` tokens over the whole group may use on any rank.

        Depends only on the token count, never on the routing (static shapes).
        """
        check_policy(policy)
        if not 1 <= total_tokens <= self.ranks * self.capacity:
            raise ValueError(
                f"total_tokens must be in [1, ranks*capacity = {self.ranks * self.capacity}], "
                f"got {total_tokens}"
            )
        epn = self.experts_per_rank
        if policy == "exact":
            real = math.ceil(total_tokens * self.top_k / self.ranks)
            return align_up(real + (self.align - 1) * 2 * epn, self.align)
        return align_up(total_tokens * self.top_k + (self.align - 1) * epn, self.align)

    def token_bytes(self, element_size: int = 2) -> int:
        """Bytes of one token row of width ``H``."""
        return self.hidden * element_size

    def expert_bytes(self, element_size: int = 2) -> int:
        """Bytes of one expert's weights (``w13`` and ``w2``)."""
        return 3 * self.hidden * self.intermediate * element_size

    def shard_bytes(self, policy: str = "exact", element_size: int = 2) -> int:
        """Bytes of one rank's receive shard at full capacity, in the planner's layout.

        The layer allocates twice this under ``exact``: its split layout
        (:func:`flatep.plan.split.split_slot_rows`) gives slot groups their own half.
        """
        return self.shard_rows(policy) * self.hidden * element_size

    def replace(self, **changes: int) -> "EPConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def check_policy(policy: str) -> None:
    """Raise ``ValueError`` unless ``policy`` is a known balancing policy."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


# Routed-expert shapes: (hidden, experts, top_k, intermediate), see shared/reference/anchors.md.
MODEL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "deepseek-v3": (7168, 256, 8, 2048),
    "kimi-k2": (7168, 384, 8, 2048),
    "kimi-k3": (3584, 896, 16, 3072),
    "qwen3-235b": (4096, 128, 8, 1536),
    "gpt-oss-120b": (2880, 128, 4, 2880),
}


def preset(model: str, ranks: int = 8, capacity: int = 8192, align: int = 128) -> EPConfig:
    """EPConfig of a real model's routed experts.

    Args:
        model: one of ``MODEL_SHAPES`` (``deepseek-v3``, ``kimi-k2``, ``kimi-k3``, ``qwen3-235b``,
            ``gpt-oss-120b``).
        ranks: EP ranks; must divide the model's expert count.
        capacity: tokens per rank ``S``.
        align: group padding.
    """
    if model not in MODEL_SHAPES:
        raise ValueError(f"model must be one of {sorted(MODEL_SHAPES)}, got {model!r}")
    hidden, experts, top_k, intermediate = MODEL_SHAPES[model]
    return EPConfig(
        ranks=ranks,
        experts=experts,
        top_k=top_k,
        hidden=hidden,
        intermediate=intermediate,
        capacity=capacity,
        align=align,
    )
