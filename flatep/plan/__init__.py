"""Planning: where every (token, k) entry goes and which experts each rank borrows for a step."""
from flatep.plan.policy import allocate, rank_capacities
from flatep.plan.reference import build_layout, entry_destinations, histogram, make_plan, plan_rank
from flatep.plan.split import split_slot_rows
from flatep.plan.types import Layout, Plan, RankPlan

__all__ = [
    "Layout",
    "Plan",
    "RankPlan",
    "allocate",
    "build_layout",
    "entry_destinations",
    "histogram",
    "make_plan",
    "plan_rank",
    "rank_capacities",
    "split_slot_rows",
]
