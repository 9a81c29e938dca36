"""Partitioners: pure functions from a cost-annotated DAG and a stage count to a `Partition`."""

from pipelaunch.pipeline.planner.partition.balanced import balanced, min_memory_cap
from pipelaunch.pipeline.planner.partition.common import (
    Partition,
    PartitionRequest,
    evaluate,
    lower_bound,
    validate_assignment,
)
from pipelaunch.pipeline.planner.partition.manual import manual
from pipelaunch.pipeline.planner.partition.milp import coarsen, milp_partition
from pipelaunch.pipeline.planner.partition.uniform import uniform

__all__ = [
    "Partition",
    "PartitionRequest",
    "balanced",
    "coarsen",
    "evaluate",
    "lower_bound",
    "manual",
    "milp_partition",
    "min_memory_cap",
    "uniform",
    "validate_assignment",
]
