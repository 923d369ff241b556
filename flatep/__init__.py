"""FlatEP: expert-parallel MoE communication whose per-rank load stays flat under any router skew."""
from flatep.config import EPConfig, MODEL_SHAPES, preset
from flatep.experts import ExpertPool, dense_moe
from flatep.layer import EPMoE, ep_moe, plan_step, prefetch_experts, route
from flatep.plan import Plan, RankPlan, make_plan, plan_rank
from flatep.plan.cost import CostProfile
from flatep.transport import Group, init_group

__all__ = [
    "CostProfile",
    "EPConfig",
    "EPMoE",
    "ExpertPool",
    "Group",
    "MODEL_SHAPES",
    "Plan",
    "RankPlan",
    "dense_moe",
    "ep_moe",
    "init_group",
    "make_plan",
    "plan_rank",
    "plan_step",
    "prefetch_experts",
    "preset",
    "route",
]
__version__ = "0.1.0"
