"""Planning: DLGS layer merging (timeline model, greedy and exact planners, profiler).

>>> from jaxcomp import planning
>>> t_s = planning.linear_cost(1.0, 0.0)
>>> t_c = planning.linear_cost(3.0, 0.5)
>>> planning.optimal_merge([4, 4, 4, 4], [2, 2, 2, 2], 0, t_s, t_c).groups
((0,), (1, 2, 3))
"""

from jaxcomp.planning.merge import (
    METHODS,
    GroupSchedule,
    LinearCost,
    MergePlan,
    Timeline,
    greedy_merge,
    linear_cost,
    merge_all,
    no_merge,
    optimal_merge,
    plan_merge,
    timeline,
)
from jaxcomp.planning.profile import (
    PROFILE_METHODS,
    BackwardProfile,
    Layer,
    ModelPlan,
    fit_sparsify_cost,
    load_sparsify_cost,
    measure_sparsify_cost,
    model_layers,
    plan_for_model,
    profile_backward,
)

# Scalability model (ldte_bs paper §4.4); method factories live in planning.scalability.
from jaxcomp.planning.scalability import (
    Cluster,
    ExchangeDecision,
    IterationTime,
    Method,
    Workload,
    compression_pays,
    gbps,
    iteration_time,
    rle_message_bytes,
    speedup,
    throughput,
)

__all__ = [
    "METHODS",
    "PROFILE_METHODS",
    "BackwardProfile",
    "GroupSchedule",
    "Layer",
    "LinearCost",
    "MergePlan",
    "ModelPlan",
    "Timeline",
    "fit_sparsify_cost",
    "greedy_merge",
    "linear_cost",
    "load_sparsify_cost",
    "measure_sparsify_cost",
    "merge_all",
    "model_layers",
    "no_merge",
    "optimal_merge",
    "plan_for_model",
    "plan_merge",
    "profile_backward",
    "timeline",
    "Cluster",
    "ExchangeDecision",
    "IterationTime",
    "Method",
    "Workload",
    "compression_pays",
    "gbps",
    "iteration_time",
    "rle_message_bytes",
    "speedup",
    "throughput",
]
