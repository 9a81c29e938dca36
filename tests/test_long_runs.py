"""Long runs: LR schedules, clipping, bf16, evaluation, checkpoints that resume exactly (bitwise on
the same layout, within float tolerance on another), export, a killed rank, a NaN. Real gloo ranks
and `python train.py` as typed."""

from __future__ import annotations

import time

import pytest
import torch

from pipelaunch.launcher.export import model_tensors
from tests.harness import (
    assert_no_process_left,
    assert_state_close,
    compose_cfg,
    job_processes,
    merge_state,
    run_jobs,
)
from tests.test_cli import metrics, train

SMALL = ["model.dim=32", "model.layers=6", "model.seq_len=16", "model.vocab_size=64", "batch_size=16", "microbatches=4",
         "warmup_steps=0", "threads=1", "timeout_s=90"]
# AdamW, cosine with warm-up over 6 steps, clipping that bites (the norm is ~0.6), bf16
RESUME = [*SMALL, "optimizer=adamw", "lr_scheduler=cosine", "lr_scheduler.warmup_steps=2",
          "lr_scheduler.total_steps=6", "clip_grad_norm=0.05"]


def _run(args: list[str], run_dir, ok: bool = True):
    proc = train(args, run_dir)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _weights(run_dir, step: int = 6) -> dict[str, torch.Tensor]:
    return model_tensors(run_dir / f"step_{step:07d}")


def check_resumed(first: list[str], then: list[str], tmp_path, at: int, steps: int) -> dict[str, torch.Tensor]:
    """`first` run uninterrupted with checkpoints (its `checkpoint.dir` under tmp_path/first);
    `then` resumed from its step `at`: the losses after `at` and the final weights within 1e-5 of
    the uninterrupted run's. Returns that run's final weights."""
    _run([*first, f"checkpoint.dir={tmp_path / 'first'}"], tmp_path / "firstrun")
    straight = metrics(tmp_path / "firstrun")["losses"]
    ref = _weights(tmp_path / "first", steps)
    _run([*then, f"resume={tmp_path / 'first' / f'step_{at:07d}'}", f"checkpoint.dir={tmp_path / 'then'}"],
         tmp_path / "thenrun")
    resumed = metrics(tmp_path / "thenrun")
    assert resumed["start_step"] == at and resumed["losses"][at:] == pytest.approx(straight[at:], rel=1e-5)
    got = _weights(tmp_path / "then", steps)
    assert set(ref) == set(got)
    for key, r in ref.items():
        assert float((got[key] - r).norm()) <= 1e-5 * float(r.norm()) + 1e-7, key
    return ref


def _assert_resumed_bitwise(straight_run, straight_ck, resumed_run, resumed_ck, start: int) -> None:
    """The resumed run follows the uninterrupted one bit for bit (same layout, same state, same
    data): losses, learning rates (warm-up included), the final weights; clipping bit every step."""
    straight, resumed = metrics(straight_run), metrics(resumed_run)
    assert resumed["start_step"] == start and resumed["resumed_from"].endswith(f"step_{start:07d}")
    assert resumed["losses"] == straight["losses"]
    assert resumed["lr"] == straight["lr"] and straight["lr"][0] < straight["lr"][1]
    assert min(straight["grad_norm"]) > 0.05
    a, c = _weights(straight_ck), _weights(resumed_ck)
    assert set(a) == set(c) and all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow  # the default suite checks the same on the killed rank's resume below
@pytest.mark.timeout(400)
def test_resume_is_bitwise_exact_with_adamw_cosine_clipping_and_bf16(tmp_path) -> None:
    args = [*RESUME, "precision=bf16", "pp=2", "checkpoint.every=3"]
    _run([*args, "steps=6", f"checkpoint.dir={tmp_path / 'straight'}"], tmp_path / "a")
    _run([*args, "steps=3", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_0000003"]
    _run([*args, "steps=6", "resume=auto", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path / "c")
    _assert_resumed_bitwise(tmp_path / "a", tmp_path / "straight", tmp_path / "c", tmp_path / "ck", 3)


@pytest.mark.timeout(500)
def test_a_checkpoint_resumes_under_another_layout(tmp_path) -> None:
    """pp=2 1f1b uniform -> pp=2 dp=2 zbv milp with its states sharded (zero=3: four stages on the
    V, each rank's first and last, instead of one stage per rank), and that -> pp=1 (nothing
    sharded): the losses of the uninterrupted pp=2 run (the checkpoint is keyed by parameter name,
    not by rank, and DCP reads each rank's part of a sharded tensor). Four ranks, not eight: a
    resume at pp=4 is tests/test_tensor_parallel.py's (from pp=2 tp=2)."""
    base = [*RESUME, "checkpoint.every=3"]
    _run([*base, "pp=2", "steps=6", f"checkpoint.dir={tmp_path / 'pp2'}"], tmp_path / "pp2run")
    straight = metrics(tmp_path / "pp2run")["losses"]
    _run([*base, "pp=2", "dp=2", "zero=3", "scheduler=zbv", "partitioner=milp", "steps=6", "checkpoint.every=2",
          f"resume={tmp_path / 'pp2' / 'step_0000003'}", f"checkpoint.dir={tmp_path / 'pp4'}"], tmp_path / "pp4run")
    wide = metrics(tmp_path / "pp4run")
    assert wide["losses"][:3] == straight[:3] and wide["start_step"] == 3
    assert wide["losses"][3:] == pytest.approx(straight[3:], rel=1e-5)
    _run([*base, "pp=1", "steps=6", f"resume={tmp_path / 'pp4' / 'step_0000004'}",
          f"checkpoint.dir={tmp_path / 'pp1'}"], tmp_path / "pp1run")
    assert metrics(tmp_path / "pp1run")["losses"][4:] == pytest.approx(straight[4:], rel=1e-5)
    ref, got = _weights(tmp_path / "pp2"), _weights(tmp_path / "pp1")
    assert set(ref) == set(got)
    for name, r in ref.items():
        # per tensor, relative to its norm: AdamW turns the key bias's gradient, rounding noise in
        # exact arithmetic, into full-size steps, so single elements of it may differ more
        assert float((got[name] - r).norm()) <= 1e-5 * float(r.norm()), name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_checkpoint_resumes_under_op_granularity(tmp_path) -> None:
    """A block-level pp=2 checkpoint resumed with `model.granularity=op` at pp=3 (cuts inside
    blocks): the names are the model's own, so the same checkpoint serves."""
    base = [*RESUME, "checkpoint.every=3"]
    _run([*base, "pp=2", "steps=6", f"checkpoint.dir={tmp_path / 'pp2'}"], tmp_path / "pp2run")
    straight = metrics(tmp_path / "pp2run")["losses"]
    _run([*base, "pp=3", "model.granularity=op", "steps=6", f"resume={tmp_path / 'pp2' / 'step_0000003'}",
          f"checkpoint.dir={tmp_path / 'op'}"], tmp_path / "oprun")
    assert metrics(tmp_path / "oprun")["losses"][3:] == pytest.approx(straight[3:], rel=1e-5)


@pytest.mark.slow  # three CLI runs (100 s); the default suite stops a job on a failed rank (test_cli) or a hung
# one (test_faults) and resumes with resume=auto bit for bit after SIGTERM (test_preemption)
@pytest.mark.timeout(400)
def test_a_killed_rank_ends_the_job_and_resume_auto_finishes_it(tmp_path) -> None:
    """The job ends promptly with the killed rank's error; `resume=auto` goes on from the last
    complete checkpoint and follows the uninterrupted run bit for bit (AdamW, a cosine LR after
    warm-up, clipping that bites, bf16): losses, learning rates and final weights."""
    base = [*RESUME, "precision=bf16", "pp=2", "steps=6", "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ck'}"]
    _run([*base[:-2], "checkpoint.every=3", f"checkpoint.dir={tmp_path / 'straight'}"], tmp_path / "straight")
    before = job_processes()
    start = time.monotonic()
    proc = _run([*base, "debug.kill_rank=1", "debug.kill_step=4"], tmp_path / "killed", ok=False)
    took = time.monotonic() - start
    assert proc.returncode == 1 and "rank 1 failed" in proc.stderr and "SIGKILL" in proc.stderr, proc.stderr[-2000:]
    assert took < 60, took  # generous on a shared 2-core machine; the job itself ends within seconds
    assert "rank 1 (pp 1, dp 0): step 4, loading the step's data" in proc.stderr  # its heartbeat
    assert_no_process_left(before)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_0000002", "step_0000004"]
    _run([*base, "resume=auto"], tmp_path / "resumed")
    _assert_resumed_bitwise(tmp_path / "straight", tmp_path / "straight", tmp_path / "resumed", tmp_path / "ck", 4)


@pytest.mark.timeout(600)
def test_clipping_lr_schedule_eval_and_bf16_match_one_process(tmp_path) -> None:
    """Global-norm clipping (active), a cosine schedule with warm-up and momentum at pp=2 and at
    pp=2 dp=2 (the norm over the stages and the replicas); eval_loss at pp=2; bf16 at pp=2 within
    1e-2 of one process's bf16."""
    from tests.reference import reference_run

    common = [*SMALL, "steps=4", "optimizer=sgd", "optimizer.momentum=0.9", "lr_scheduler=cosine",
              "lr_scheduler.warmup_steps=1", "clip_grad_norm=0.3", "eval.every=2", "eval.batches=2"]
    cases = {
        "pp=2": compose_cfg([*common, "pp=2"]),
        "pp=2 bf16": compose_cfg([*common, "pp=2", "precision=bf16"]),
        "pp=2 dp=2": compose_cfg([*common, "pp=2", "dp=2", "scheduler=zbv", "partitioner=milp"]),
    }
    two = run_jobs([cases["pp=2"], cases["pp=2 bf16"]], tmp_path / "two")
    four = run_jobs([cases["pp=2 dp=2"]], tmp_path / "four")
    for what, ranks in (("pp=2", two[0]), ("pp=2 dp=2", four[0])):
        cfg = cases[what]
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} weights")
        m = ranks[0].history
        assert min(m.grad_norm) > 0.3, m.grad_norm  # clipping was active
        assert [e["step"] for e in m.eval_loss] == [1, 3]
        assert [e["eval_loss"] for e in m.eval_loss] == pytest.approx(
            [e["eval_loss"] for e in ref["eval_losses"]], rel=1e-5), what
    bf16, ref16 = two[1][0], reference_run(cases["pp=2 bf16"])
    assert bf16.losses == pytest.approx(ref16["losses"], rel=1e-2)
    assert bf16.losses != pytest.approx(ref["losses"], rel=1e-6)  # it did run in bf16


def test_nan_stops_the_job_naming_the_step_and_the_stage(tmp_path) -> None:
    proc = _run([*SMALL, "model.layers=8", "pp=2", "steps=5", "model._target_=tests.faulty.nan_gpt",
                 "+model.nan_block=layer5", "+model.calls=8"], tmp_path / "run", ok=False)
    assert proc.returncode == 1
    assert "the loss became nan at step 2" in proc.stderr, proc.stderr[-3000:]
    assert "the outputs of stage 1 (pipeline rank 1" in proc.stderr


def test_bad_training_keys_are_refused_before_any_rank(tmp_path) -> None:
    from pipelaunch.launcher.validate import prepare
    from pipelaunch.pipeline.core.errors import ConfigError

    for override, key in (("clip_grad_norm=-1", "clip_grad_norm"), ("precision=fp8", "precision"),
                          ("lr_scheduler.min_lr_ratio=2", "lr_scheduler.min_lr_ratio"),
                          ("eval.every=-1", "eval.every"), ("checkpoint.keep=-2", "checkpoint.keep"),
                          ("debug.kill_rank=9", "debug.kill_rank"), (f"resume={tmp_path}", "resume"),
                          ("resume=/nonexistent/step_1", "resume")):
        with pytest.raises(ConfigError) as info:
            prepare(compose_cfg([*SMALL, override]))
        assert info.value.key == key, (override, str(info.value))
