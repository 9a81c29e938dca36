"""The step under data.buckets, priced by the simulator on the run's own micro-batch lengths.

The plan is priced at model.seq_len (its memory budget must hold for the longest micro-batch).
Which lengths a step's micro-batches run at is known before the run: a function of (seed, step)
(pipeline/data/lengths.py). So the first steps of the run are simulated each on its own lengths:
every compute action of a micro-batch takes the stage's time at model.seq_len scaled by the
micro-batch's length over model.seq_len (linear in tokens: attention's part that grows with the
square of the length is priced linearly, an over-estimate for short micro-batches of a long-context
model), each replica's pipeline on its own micro-batches, the step the slowest replica's. What the
step adds past the schedule (the optimizer, the replicas' collectives) is as at model.seq_len.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from pipelaunch.pipeline.planner.predict.prediction import Prediction
from pipelaunch.pipeline.planner.predict.simulate import simulate


def price_lengths(prediction: Prediction, step_lengths: Sequence[Sequence[int]], longest: int) -> dict:
    """`prediction`'s step on each step's micro-batch lengths (every replica's, in order): the mean
    and each step's predicted time, beside the step at model.seq_len (`PlannedStep.variable_lengths`)."""
    plan, cost = prediction.plan, prediction.cost
    m = plan.microbatches
    # ranks sharing too few cores stretch the schedule (shared_cores.py): kept in proportion
    stretch = prediction.schedule_s / prediction.result.makespan_s if prediction.result.makespan_s > 0 else 1.0
    past_schedule = prediction.step_s - prediction.schedule_s
    steps = []
    for lengths in step_lengths:
        makespan = 0.0
        for replica in range(len(lengths) // m):
            scale = [length / longest for length in lengths[replica * m:(replica + 1) * m]]
            result = simulate(plan.schedule, replace(cost, microbatch_scale=scale), check=False, memory=False)
            makespan = max(makespan, result.makespan_s)
        steps.append(makespan * stretch + past_schedule)
    return {"steps_priced": len(steps), "step_time_s": statistics.fmean(steps) if steps else prediction.step_s,
            "step_times_s": steps, "longest_step_time_s": prediction.step_s,
            "mean_length": statistics.fmean(x for lengths in step_lengths for x in lengths) if steps else longest}
