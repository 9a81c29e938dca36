"""The update phase's memory: after the backward, the optimizer step's temporaries (and dp's flat
gradient copy) are priced, measured on the configured optimizer, and the device peak is the larger
of the backward's and the update's."""

from __future__ import annotations

import pytest

from pipelaunch.launcher.plugins import optimizer_spec
from pipelaunch.pipeline.planner.measure.optimizer_costs import _step_rise, measure_temporaries
from pipelaunch.pipeline.planner.predict.memory import MIB, UpdateMemory, device_memory

ADAMW = optimizer_spec({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3})
SGD_MOMENTUM = optimizer_spec({"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.9})
N = 1 << 14


@pytest.mark.parametrize(("optimizer", "cuda"), [(ADAMW, False), (ADAMW, True), (SGD_MOMENTUM, False)])
def test_the_temporaries_measured_on_equal_tensors_price_a_step_over_unequal_ones(optimizer, cuda) -> None:
    """Measured on two and four equal tensors, the coefficients bound a step over tensors of other
    sizes in another order, and closely: foreach AdamW holds one copy of everything (exact); the
    single-tensor one two copies of the tensor it updates and one of the tensor before it, priced
    as three of the largest (here 7 against 9 units); SGD with momentum nothing."""
    per_largest, per_all = measure_temporaries(optimizer, cuda, N)
    sizes = [N, 3 * N, N // 2, 2 * N, N]
    predicted = 4 * (per_largest * max(sizes) + per_all * sum(sizes))
    measured = _step_rise(optimizer, cuda, sizes)
    assert measured <= predicted * 1.02 + 1024 and predicted <= measured * 1.3 + 1024, (predicted, measured)


def test_a_device_peak_is_the_larger_of_its_backward_and_its_update() -> None:
    update = UpdateMemory(largest_param_bytes=[4 * MIB, 1 * MIB], temporaries=(3.0, 0.0), dp=1)
    small, large = device_memory([10 * MIB, 6 * MIB], [0, 1], [2 * MIB, 20 * MIB], 2,
                                 workspace_bytes=[1 * MIB, 1 * MIB], reserve_bytes=5 * MIB, update=update)
    assert small.update == 12 * MIB and small.total == 40 * MIB + 12 * MIB + 5 * MIB
    assert "update 12.0 (more than the backward's activations 2.0 + workspace 1.0)" in small.breakdown()
    assert large.update == 3 * MIB and large.total == 24 * MIB + 21 * MIB + 5 * MIB
    assert "update" not in large.breakdown()
    # data parallel: the all-reduce's flat copy of every gradient, before the optimizer's step
    flat = device_memory([10 * MIB], [0], [0.0], 0, update=UpdateMemory([4 * MIB], (0.0, 0.0), dp=2))[0]
    assert flat.update == 10 * MIB
