"""Tracing (meta device), per-leaf profiling and stage splitting: from an nn.Module to a
cost-annotated DAG and stage modules. Import the submodules directly: a rank needs `trace` and
`split` to build its stages, never the profiler."""
