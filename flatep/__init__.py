"""FlatEP: expert-parallel MoE communication whose per-rank load stays flat under any router skew."""
from flatep.config import EPConfig, MODEL_SHAPES, preset
from flatep.plan import Plan, RankPlan, make_plan, plan_rank

__all__ = ["EPConfig", "MODEL_SHAPES", "Plan", "RankPlan", "make_plan", "plan_rank", "preset"]
__version__ = "0.1.0"
