"""``policy="auto"``: per step, the candidate plan with the lowest predicted slowest-rank time.

The candidates, in this fixed order (ties go to the first): classic (``none``: nothing moves),
``bounded`` for each tolerance of :data:`LADDER` ascending (only the surplus above ``(1+t)`` times
the mean moves), and ``exact`` with tolerance 0 (flat). Every candidate is planned from the
gathered histogram, :func:`flatep.plan.cost.predict` gives each one's per-rank time, and the choice
is the first ``argmin`` of the busiest rank's time: a device tensor, never read on the host, so a
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
    """

    candidates: tuple[Candidate, ...]
    choice: torch.Tensor
    prediction: Prediction

    def chosen(self, values: torch.Tensor) -> torch.Tensor:
        """Row ``choice`` of a ``[C, ...]`` tensor, on the device (no host sync)."""
        return values.index_select(0, self.choice.view(1)).squeeze(0)

    def report(self) -> dict:
        """The choice for reports (reads the device: a host sync). Keys: ``choice`` (label),
        ``policy``, ``tolerance``, ``predicted_us`` (busiest rank), ``predicted_rank_us`` ``[R]``,
        ``experts_moved``, ``bytes_moved``."""
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
        }


def choose(prediction: Prediction) -> torch.Tensor:
    """``[] int64``: the first candidate with the least busiest-rank time (``torch.argmin`` returns the first)."""
    return torch.argmin(prediction.layer_fs)


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
    prediction = predictor(tokens_per_expert.to(alloc.device), alloc, cost.constants(config))
    choice = choose(prediction)
    auto = AutoChoice(candidates=candidates, choice=choice, prediction=prediction)
    changes: dict[str, object] = {
        name: auto.chosen(torch.stack([getattr(plan, name) for plan in plans]))
        for name in plans[0].tensors()
    }
    changes.update(
        policy="auto",
        shard_rows=config.step_rows(total_tokens, "auto"),
        slot_rows=slot_rows(config, total_tokens, candidates),
        auto=auto,
    )
    return dataclasses.replace(plans[0], **changes)


def plan_candidates(plan_one: Callable[[EPConfig, str], L], config: EPConfig, candidates: tuple[Candidate, ...] = CANDIDATES) -> list[L]:
    """``plan_one(candidate_config, policy)`` for every candidate, in order."""
    return [plan_one(candidate.config(config), candidate.policy) for candidate in candidates]


def auto_layout(
    tokens_per_expert: torch.Tensor, config: EPConfig, total_tokens: int, step_tokens: int, cost: CostProfile | None
) -> Layout:
    """:func:`flatep.plan.build_layout` under ``auto``: every candidate's layout by the reference, then :func:`select`."""
    layouts = plan_candidates(
        lambda candidate, policy: build_layout(tokens_per_expert, candidate, policy, total_tokens, step_tokens), config
    )
    return select(layouts, tokens_per_expert, config, cost, total_tokens)
