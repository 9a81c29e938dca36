"""What the planner measures on this machine: the traced model per micro-batch size, each leaf's costs, the runtime's overheads, the optimizer's costs, bf16 dtypes."""
