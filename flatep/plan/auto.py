"""``policy="auto"``: per step, the candidate plan with the lowest predicted slowest-rank time.

The candidates, in this fixed order (ties go to the first): classic (``none``: nothing moves),
``bounded`` for each tolerance of :data:`LADDER` ascending (only the surplus above ``(1+t)`` times
the mean moves), and ``exact`` with tolerance 0 (flat). Every candidate is planned from the
gathered histogram, :func:`flatep.plan.cost.predict` gives each one's per-rank time, and the choice
is the first ``argmin`` of the busiest rank's time, a candidate that moves weights charged the
profile's decision margin (:func:`choose`): a device tensor, never read on the host, so a
captured CUDA graph replays the decision for whatever routing it sees. The plan's tables are the
chosen candidate's, gathered with ``index_select`` on the device.

An auto plan has policy ``"auto"``; its :class:`AutoChoice` (``plan.auto``) records the candidates,
the choice and the model's predictions. Its shard is sized for every candidate: the home half like
classic EP (``EPConfig.step_rows(T, "auto")``), the slot half like the largest borrowing candidate
(``Layout.slot_rows``, used by :func:`flatep.plan.split.split_slot_rows`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from flatep.config import EPConfig
from flatep.plan.cost import CostConstants, CostProfile, Prediction, predict
from flatep.plan.reference import build_layout
from flatep.plan.types import Layout

LADDER = (0.05, 0.1, 0.25, 0.5)
"""Tolerances of the ``bounded`` candidates, ascending."""

L = TypeVar("L", bound=Layout)


@dataclass(frozen=True)
class Candidate:
    """One plan ``auto`` considers: a policy and the tolerance it runs with."""

    policy: str
    tolerance: float = 0.0

    def label(self) -> str:
        """``classic``, ``bounded t=0.1`` or ``exact``."""
        if self.policy == "none":
            return "classic"
        return f"bounded t={self.tolerance:g}" if self.policy == "bounded" else self.policy

    def config(self, config: EPConfig) -> EPConfig:
        """``config`` with this candidate's tolerance."""
        return config.replace(tolerance=self.tolerance)


CANDIDATES = (Candidate("none"), *(Candidate("bounded", t) for t in LADDER), Candidate("exact"))
"""The candidates of ``auto``, in tie-break order."""


@dataclass
class AutoChoice:
    """What ``auto`` chose for a step, and why.

    Attributes:
        candidates: the candidates, in order (host).
        choice: ``[] int64`` index of the chosen candidate, on the plan's device.
        prediction: the model's :class:`~flatep.plan.cost.Prediction` for every candidate
            (``rank_fs [C, R]``, ``layer_fs``, ``experts_moved``, ``bytes_moved`` ``[C]``, int64,
            femtoseconds and bytes).
        margin_ppm: the decision margin the choice charged moving candidates, in millionths
            of classic's predicted time (:meth:`flatep.CostProfile.margin`).
    """

    candidates: tuple[Candidate, ...]
    choice: torch.Tensor
    prediction: Prediction
    margin_ppm: int = 0

    def chosen(self, values: torch.Tensor) -> torch.Tensor:
        """Row ``choice`` of a ``[C, ...]`` tensor, on the device (no host sync)."""
        return values.index_select(0, self.choice.view(1)).squeeze(0)

    def report(self) -> dict:
        """The choice for reports (reads the device: a host sync). Keys: ``choice`` (label),
        ``policy``, ``tolerance``, ``predicted_us`` (busiest rank), ``predicted_rank_us`` ``[R]``,
        ``experts_moved``, ``bytes_moved``, ``margin`` (a fraction)."""
        index = int(self.choice)
        candidate = self.candidates[index]
        prediction = self.prediction
        return {
            "choice": candidate.label(),
            "policy": candidate.policy,
            "tolerance": candidate.tolerance,
            "predicted_us": int(prediction.layer_fs[index]) / 1e9,
            "predicted_rank_us": [value / 1e9 for value in prediction.rank_fs[index].tolist()],
            "experts_moved": int(prediction.experts_moved[index]),
            "bytes_moved": int(prediction.bytes_moved[index]),
            "margin": self.margin_ppm / 1e6,
        }


def moving_never_pays(config: EPConfig, cost: CostProfile, total_tokens: int) -> bool:
    """Whether, for any routing of ``T`` tokens, the model puts no candidate that moves weights below classic.

    A host-side bound from ``T`` alone (no device data): under classic the busiest rank is ``b``.
    Moving weights can lower ``b``'s time only through experts ``b`` lends (the rows it sheds) or
    borrows (its tokens that stop crossing the link), and each such expert costs ``b`` at least one
    expert's push over the link, paired at worst with one lent and one borrowed expert (the push term
    is ``max(lent, borrowed)``). An expert holds at most ``n = T`` rows: a router picks ``K``
    distinct experts per token. A lent expert then saves at most ``group + max(weight,
    ceil(n/tile)*tile*row) + n*row_bytes*link`` and a borrowed one at most ``n*row_bytes*link``.
    When one push costs at least both savings together, every moving candidate leaves ``b`` at
    least as slow, so its layer time is at least classic's, and classic wins the tie. Then ``auto``
    need not plan the other candidates: at decode sizes it plans classic only, and pays classic's
    planning time. Exact in the model's integer arithmetic.

    Routings that repeat an expert within a token (allowed, e.g. :func:`flatep.routing.adversarial_topk`'s
    ``one``) can give an expert up to ``T*K`` rows; for them the pruned step is still correct and
    classic, but the model might have preferred moving.
    """
    constants = cost.constants(config, total_tokens=total_tokens)
    rows = total_tokens
    tiles = -(-rows // constants.tile_rows)
    row_link = rows * constants.row_bytes * constants.byte_fs
    lent_saving = constants.group_fs + max(constants.weight_fs, tiles * constants.tile_rows * constants.row_fs) + row_link
    return constants.weight_bytes * constants.byte_fs >= lent_saving + row_link


def candidates_for(config: EPConfig, cost: CostProfile | None, total_tokens: int) -> tuple[Candidate, ...]:
    """The candidates ``auto`` plans for a step of ``T`` tokens: classic alone when
    :func:`moving_never_pays`, else all of :data:`CANDIDATES`."""
    cost = CostProfile.default() if cost is None else cost
    return CANDIDATES[:1] if moving_never_pays(config, cost, total_tokens) else CANDIDATES


def choose(prediction: Prediction, margin_ppm: int = 0) -> torch.Tensor:
    """``[] int64``: the first candidate with the least score (``torch.argmin`` returns the first).

    A candidate's score is its busiest-rank time, plus, if it moves any expert, ``margin_ppm``
    millionths of classic's time (candidate 0): a moving candidate wins only when the model puts
    it faster than classic by more than the margin (:meth:`flatep.CostProfile.margin`). Integer
    arithmetic, as :func:`flatep.plan.cost_triton.choose_triton`.
    """
    layer_fs = prediction.layer_fs
    penalty = (layer_fs[0] // 10**6) * margin_ppm
    return torch.argmin(layer_fs + torch.where(prediction.experts_moved > 0, penalty, 0))


def slot_rows(config: EPConfig, total_tokens: int, candidates: tuple[Candidate, ...] = CANDIDATES) -> int:
    """Rows the slot half of an auto shard needs: the most any borrowing candidate's shard uses."""
    return max(
        candidate.config(config).step_rows(total_tokens, candidate.policy)
        for candidate in candidates
        if candidate.policy != "none"
    )


def select(
    plans: list[L],
    tokens_per_expert: torch.Tensor,
    config: EPConfig,
    cost: CostProfile | None,
    total_tokens: int,
    candidates: tuple[Candidate, ...] = CANDIDATES,
    predictor: Callable[[torch.Tensor, torch.Tensor, CostConstants], Prediction] = predict,
) -> L:
    """The auto plan from every candidate's plan: the model's choice, gathered on the device.

    Args:
        plans: one plan per candidate (same type, same device, planner's layout, not split).
        tokens_per_expert: ``[R, E]`` the gathered histogram the plans were made from.
        config: group sizes; cost: the profile (default :meth:`CostProfile.default`).
        total_tokens: tokens over the group ``T``.
        predictor: evaluates the model (:func:`flatep.plan.cost.predict`, or the one-launch
            :func:`flatep.plan.cost_triton.predict_triton` of the Triton planners: the same integers).

    Returns:
        A plan of ``plans[0]``'s type: policy ``"auto"``, every tensor field the chosen
        candidate's, ``shard_rows = config.step_rows(T, "auto")``, ``slot_rows`` for the slot half,
        and ``auto`` the :class:`AutoChoice`.
    """
    if len(plans) != len(candidates):
        raise ValueError(f"pass one plan per candidate ({len(candidates)}), got {len(plans)}")
    cost = CostProfile.default() if cost is None else cost
    if not isinstance(cost, CostProfile):
        raise ValueError(f"cost must be a flatep.CostProfile, got {type(cost).__name__}")
    alloc = torch.stack([plan.alloc for plan in plans])  # [C, E, R]
    constants = cost.constants(config, total_tokens=total_tokens)
    prediction = predictor(tokens_per_expert.to(alloc.device), alloc, constants)
    choice = choose(prediction, constants.margin_ppm)
    auto = AutoChoice(candidates=candidates, choice=choice, prediction=prediction, margin_ppm=constants.margin_ppm)
    changes: dict[str, object] = {
        name: auto.chosen(torch.stack([getattr(plan, name) for plan in plans]))
        for name in plans[0].tensors()
    }
    changes.update(
        policy="auto",
        shard_rows=config.step_rows(total_tokens, "auto"),
        # Sized for every candidate, also when fewer were planned: the step's shapes stay those of auto.
        slot_rows=slot_rows(config, total_tokens),
        auto=auto,
    )
    return dataclasses.replace(plans[0], **changes)


def auto_layout(
    tokens_per_expert: torch.Tensor, config: EPConfig, total_tokens: int, step_tokens: int, cost: CostProfile | None
) -> Layout:
    """:func:`flatep.plan.build_layout` under ``auto``: every candidate's layout by the reference, then :func:`select`."""
    candidates = candidates_for(config, cost, total_tokens)
    busiest = int(tokens_per_expert.sum(0).view(config.ranks, -1).sum(1).max())  # rows homed on the busiest rank
    layouts: list[Layout] = []
    for candidate in candidates:
        candidate_config = candidate.config(config)
        if candidate.policy == "bounded":
            limit = candidate_config.bounded_rows(total_tokens)
        else:
            limit = candidate_config.rebalance_limit(total_tokens)
        if layouts and candidate.policy != "none" and busiest <= limit:
            # A candidate whose bound the step already meets keeps every row at home: classic's tables.
            layouts.append(layouts[0])
        else:
            layouts.append(build_layout(tokens_per_expert, candidate_config, candidate.policy, total_tokens, step_tokens))
    return select(layouts, tokens_per_expert, config, cost, total_tokens, candidates)
