"""A plan's step and memory before any rank runs: cost models, the simulator, shared cores, each device's peak."""
