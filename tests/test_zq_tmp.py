import os, pytest
from pathlib import Path
from tests.harness import FAST, assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

def test_z():
    cases=[]
    for sched in os.environ["ZS"].split(","):
        for z in os.environ["ZL"].split(","):
            cases.append((compose_cfg([*FAST, f"scheduler={sched}", "pp=2", "dp=2", "microbatches=4", f"zero={z}"]+os.environ.get("ZX","").split()), f"{sched} zero={z}"))
    results = run_jobs([c for c,_ in cases], Path("/tmp/zq-logs"))
    for (cfg, what), ranks in zip(cases, results):
        ref = reference_run(cfg)
        print(what, ranks[0].losses[:3], ref["losses"][:3])
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} {d} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} {d} weights")
