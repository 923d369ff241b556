"""EPConfig: the numbers that size an expert-parallel group, and presets for real models."""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

POLICIES = ("exact", "none", "bounded", "auto")
# Tolerances travel in fixed point so that the host, the reference planner and the GPU kernels
# compute the same integer bound: ``tolerance_fixed = round(tolerance * TOLERANCE_SCALE)``.
TOLERANCE_BITS = 20
TOLERANCE_SCALE = 1 << TOLERANCE_BITS
# Keeps ``entries * (TOLERANCE_SCALE + tolerance_fixed)`` inside int64 for ``entries < 2**31``.
MAX_TOLERANCE = 1024


MIN_STEP_ALIGN = 16
"""The smallest group padding :meth:`EPConfig.step_align` picks (when ``align`` allows)."""


def next_pow2(value: int) -> int:
    """The smallest power of two ``>= value`` (1 for ``value <= 1``)."""
    return 1 << max(int(value) - 1, 0).bit_length()


def align_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= value``."""
    return -(-value // multiple) * multiple


def rows_per_expert(total_tokens: int, top_k: int, experts: int) -> int:
    """``ceil(T*K/E)``: the rows an expert holds on average in a step of ``T`` tokens over the group
    (a host int, from the sizes alone: what the expert kernels and their tiles follow)."""
    return -(-total_tokens * top_k // experts)


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
        align: every non-empty expert group of a shard is padded to a multiple of at most this:
            a step pads to :meth:`step_align` of its token count, smaller for small steps.
        tolerance: the rank imbalance a step may keep, in ``[0, 1024]``. Under ``exact`` a step
            is rebalanced only when its busiest rank would compute more than
            :meth:`rebalance_limit` rows, about ``(1 + tolerance)`` times the mean; otherwise
            every expert stays home and no weights move. Under ``bounded`` it is the bound
            itself: every rank computes at most :meth:`bounded_rows` rows and only the surplus
            above it moves. ``0`` (default) balances every uneven step; a larger value moves
            fewer experts, at the price of shards that hold ``(1 + tolerance)`` times the mean
            rows. Planners use it in fixed point (:attr:`tolerance_fixed`).
        dedup: send each token once per destination rank (off by default: on one GPU, where
            virtual ranks share the memory and no link bytes are saved, its expansion and run
            sums are extra local copies and its combine is slower than the per-entry one; see
            ``docs/decode.md``). A token whose ``K``
            experts live on fewer than ``K`` ranks crosses the link once per rank: dispatch sends
            the row of the token's first entry (in ``k`` order) bound for each rank, and that rank
            copies it into the token's other rows there; combine first sums, on each computing
            rank, the token's rows computed there (ascending ``k``) into one partial sum, and
            sends that back (see :class:`flatep.plan.types.Plan`). ``False``: every entry's row
            crosses the link on its own.
    """

    ranks: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    capacity: int
    align: int = 128
    tolerance: float = 0.0
    dedup: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "dedup":
                if not isinstance(value, bool):
                    raise ValueError(f"EPConfig.dedup must be True or False, got {value!r}")
            elif field.name == "tolerance":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TOLERANCE:
                    raise ValueError(
                        f"EPConfig.tolerance must be a finite number >= 0 and <= {MAX_TOLERANCE}, got {value!r}"
                    )
            else:
                try:  # numpy and other integer types count as integers; bool, float and str do not
                    number = None if isinstance(value, bool) else operator.index(value)
                except TypeError:
                    number = None
                if number is None or number < 1:
                    raise ValueError(f"EPConfig.{field.name} must be a positive integer, got {value!r}")
                object.__setattr__(self, field.name, number)
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

        ``exact`` and ``bounded``: ``NvS = align_up(S*K + (align-1)*2*epn, align)`` (with
        ``tolerance``, ``S*K`` becomes ``max(S*K, floor((1+tolerance)*S*K))``).
        ``none`` (classic EP): a rank may receive every entry of the group,
        ``align_up(R*S*K + (align-1)*epn, align)``; ``auto`` likewise (the home half of its shard:
        the slot half is sized by :func:`flatep.plan.auto.slot_rows`).
        """
        return self.step_rows(self.ranks * self.capacity, policy)

    def step_align(self, total_tokens: int) -> int:
        """Group padding of a step with ``total_tokens`` tokens over the group (``T``).

        The rule: the power of two at or above the mean rows per expert, ``T*K/E``, within
        ``[min(16, align), align]``. Large steps keep ``align`` (Kimi-K2 at 8 ranks: from 64 tokens
        per rank on, with the default 128); decode steps pad to 16 or 32 rows, so that the grouped GEMMs
        and the row-wise expert kernels touch a few padding rows per group instead of up to 127
        (on the H200 at Kimi-K2, s=128, when dispatch still zeroed padding: dispatch 237-280 us
        with 128, 71-76 us with 16; dispatch no longer writes padding rows at all). A plan,
        its shard rows and its padding all follow from ``T``, so every rank and planner agrees, and
        buffers sized at capacity with ``align`` hold every step.
        """
        mean_rows = -(-total_tokens * self.top_k // self.experts)
        return min(self.align, max(min(MIN_STEP_ALIGN, self.align), next_pow2(mean_rows)))

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
        epn, align = self.experts_per_rank, self.step_align(total_tokens)
        if policy in ("exact", "bounded"):
            # exact: a balanced rank computes at most ceil(T*K/R) rows, an unbalanced step that is
            # let pass leaves every rank at most rebalance_limit rows; bounded: at most the same
            # maximum of the two (bounded_rows). Slots may hold a borrowed group per home group.
            real = self.bounded_rows(total_tokens)
            return align_up(real + (align - 1) * 2 * epn, align)
        return align_up(total_tokens * self.top_k + (align - 1) * epn, align)

    @property
    def tolerance_fixed(self) -> int:
        """``round(tolerance * TOLERANCE_SCALE)``: the tolerance as the planners' kernels use it."""
        return tolerance_fixed(self.tolerance)

    def rebalance_limit(self, total_tokens: int) -> int:
        """Rows the busiest rank may compute before ``exact`` rebalances a step with ``total_tokens``
        tokens over the group: about ``floor((1 + tolerance) * T*K / R)``, exactly
        :func:`rows_bound` ``(T*K, R, tolerance_fixed)``.

        With ``tolerance = 0`` only perfectly even steps stay unbalanced (they need no move).
        """
        return rows_bound(total_tokens * self.top_k, self.ranks, self.tolerance_fixed)

    def bounded_rows(self, total_tokens: int) -> int:
        """``b``: the most real rows any rank computes under ``bounded`` (``T`` = ``total_tokens``).

        ``max(ceil(T*K/R), rebalance_limit(T))``: the tolerance's bound, but never below the
        mean rounded up, which the ``R`` ranks need to hold all ``T*K`` rows.
        """
        entries = total_tokens * self.top_k
        return max(-(-entries // self.ranks), self.rebalance_limit(total_tokens))

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

    def replace(self, **changes: float | bool) -> "EPConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def tolerance_fixed(tolerance: float) -> int:
    """``round(tolerance * TOLERANCE_SCALE)``; ``tolerance`` must be in ``[0, MAX_TOLERANCE]``."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance <= MAX_TOLERANCE:
        raise ValueError(f"tolerance must be a finite number >= 0 and <= {MAX_TOLERANCE}, got {tolerance!r}")
    return round(tolerance * TOLERANCE_SCALE)


def rows_bound(entries: int, ranks: int, fixed: int) -> int:
    """``floor(entries * (1 + fixed / TOLERANCE_SCALE) / ranks)`` in integers.

    The one definition of the imbalance bound: ``(entries * (TOLERANCE_SCALE + fixed)) //
    (ranks * TOLERANCE_SCALE)``. The Triton planner evaluates the same expression in int64 from
    ``entries`` and ``fixed`` on the device (``entries < 2**31`` and ``fixed <= MAX_TOLERANCE *
    TOLERANCE_SCALE`` keep the product below ``2**63``).
    """
    return entries * (TOLERANCE_SCALE + fixed) // (ranks * TOLERANCE_SCALE)


def check_policy(policy: str) -> None:
    """Raise ``ValueError`` unless ``policy`` is a known balancing policy."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


# Routed-expert shapes: (hidden, experts, top_k, intermediate), from the models' published configs.
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
