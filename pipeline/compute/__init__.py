"""How one process computes, as both the planner (measuring) and a rank (running) need it: the
I/W backward split, the thread policy, the host allocator and the tensor-peak counters. It sits
below planner and runtime, so the planner measures exactly what a rank runs without importing
the runtime."""
