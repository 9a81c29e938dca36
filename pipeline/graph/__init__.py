"""Tracing, profiling and splitting: from an nn.Module to a cost-annotated DAG and stage modules."""

from pipeline.graph.profile import BlockCost, chain_graph, profile_blocks, profile_graph
from pipeline.graph.split import SplitModel, StageIO, run_stages, split_model
from pipeline.graph.trace import TracedModel, TraceError, trace_model

__all__ = [
    "BlockCost",
    "SplitModel",
    "StageIO",
    "TraceError",
    "TracedModel",
    "chain_graph",
    "profile_blocks",
    "profile_graph",
    "run_stages",
    "split_model",
    "trace_model",
]
