"""Property-based: any command line either plans, or is refused with a ConfigError naming a key.

Hypothesis draws overrides from the whole config space: every top-level key and group, the
fields of group options, valid and invalid values, wrong types, unknown options and unknown keys.
Each drawn command line goes through what `python train.py ... mode=plan` does before any rank
exists (the override rewrite, Hydra's composition, `prepare`); anything but success or a
ConfigError is a bug. The case count is printed (docs/config.md says how to see it).
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelaunch.launcher.overrides import compose_checked, rewrite_lists
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError

BAD_NUMBERS = ["0", "-1", "-4", "abc", "2.5", "null", "[1,2]", "1e40"]
VALUES: dict[str, list[str]] = {
    "pp": ["1", "2", "3", "4", *BAD_NUMBERS],
    "dp": ["1", "2", *BAD_NUMBERS],
    "microbatches": ["1", "2", "4", "8", *BAD_NUMBERS],
    "batch_size": ["8", "16", "32", *BAD_NUMBERS],
    "steps": ["1", "3", *BAD_NUMBERS],
    "warmup_steps": ["0", "1", *BAD_NUMBERS],
    "seed": ["0", "7", "abc"],
    "device": ["auto", "cpu", "cuda", "tpu", "3"],
    "remat": ["none", "selective", "full", "stage", "auto", "some"],
    "plan": ["manual", "auto", "best"],
    "plan.microbatches": ["[2,4]", "[3]", "abc", "[x]"],
    "predict": ["true", "false", "maybe"],
    "check_split": ["auto", "always", "never", "true", "false", "on", "3"],
    "log_every": ["1", "5", *BAD_NUMBERS],
    "timeout_s": ["30", "120", *BAD_NUMBERS],
    "threads": ["0", "1", "2", *BAD_NUMBERS],
    "host_allocator": ["retain", "system", "fast"],
    "huge_pages": ["true", "false", "maybe"],
    "cpu_affinity": ["auto", "none", "all"],
    "clip_grad_norm": ["null", "1.0", "0.1", "-1", "abc", "0"],
    "precision": ["fp32", "bf16", "fp16", "8"],
    "resume": ["none", "auto", "/nonexistent/step_0000001"],
    "link_latency_s": ["5e-5", "-1", "abc"],
    "link_bandwidth": ["1e9", "0", "abc"],
    "model": ["gpt", "mlp", "unet", "resnet", "hf_gpt2_tiny", "hf_llama_tiny", "transformer_xl"],
    "data": ["synthetic", "text", "images", "tokens", "hf", "imagenet"],
    "scheduler": ["1f1b", "gpipe", "zbv", "zb_h1", "zb_h2", "hanayo", "interleaved_1f1b", "inference", "auto",
                  "pipedream"],
    "partitioner": ["uniform", "balanced", "milp", "manual", "random"],
    "placement": ["auto", "linear", "interleaved", "v", "explicit", "[0,1]", "[0,1,1,0]", "[0,5]", "diagonal"],
    "optimizer": ["sgd", "adamw", "lamb"],
    "lr_scheduler": ["constant", "cosine", "linear", "step"],
    "memory": ["unlimited", "budget", "infinite"],
    "model.dim": ["32", "64", "-4", "0", "abc"],
    "model.layers": ["2", "6", "0", "-1", "x"],
    "model.heads": ["2", "3", "4", "0", "abc"],
    "model.seq_len": ["8", "16", "0", "abc"],
    "model.vocab_size": ["64", "256", "0", "-3"],
    "optimizer.lr": ["0.01", "1e-3", "-1", "abc", "0"],
    "data.paths": ["[/nonexistent]", "null"],
    "data.image_size": ["8", "0", "-2"],
    "eval.every": ["0", "2", "-1", "x"],
    "eval.batches": ["1", "0", "x"],
    "checkpoint.every": ["0", "2", "-5"],
    "checkpoint.keep": ["0", "3", "-1"],
    "lr_scheduler.warmup_steps": ["0", "2", "-1", "1.5"],
    "lr_scheduler.min_lr_ratio": ["0.0", "0.5", "2", "-0.1"],
    "memory.cap_bytes": ["1e9", "-1", "abc", "10"],
    "debug.kill_rank": ["null", "0", "99", "abc"],
    "debug.kill_step": ["null", "1", "-1"],
    "partitioner.split_points": ["[layer2]", "[nowhere]", "[]"],
    "nonexistent_key": ["1"],
    "+foo": ["1"],
    "model.nonexistent": ["1"],
}
# small and quick unless an override says otherwise
BASE = ["mode=plan", "model.dim=32", "model.layers=4", "model.seq_len=8", "model.vocab_size=64", "batch_size=16",
        "steps=2", "threads=1"]


def _override(key: str, value: str) -> str:
    return f"{key}={value}"


@st.composite
def command_lines(draw) -> list[str]:
    keys = draw(st.lists(st.sampled_from(sorted(VALUES)), min_size=1, max_size=4, unique=True))
    return [_override(k, draw(st.sampled_from(VALUES[k]))) for k in keys]


CASES = {"n": 0, "planned": 0, "refused": 0}


def _check(overrides: list[str]) -> None:
    line = rewrite_lists([*BASE, *overrides])
    try:
        cfg = compose_checked(line)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepare(cfg, profile=False)
        CASES["planned"] += 1
    except ConfigError as err:
        assert err.key and str(err).startswith(f"Invalid config `{err.key}`"), (overrides, err)
        CASES["refused"] += 1
    CASES["n"] += 1


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(command_lines())
def test_any_command_line_plans_or_is_refused_with_a_named_key(overrides: list[str]) -> None:
    _check(overrides)


@pytest.mark.parametrize("overrides", [[f"{k}={v}"] for k in sorted(VALUES) for v in VALUES[k]])
def test_every_single_override(overrides: list[str]) -> None:
    """Each value of the catalogue on its own (hypothesis then mixes them)."""
    _check(overrides)


def test_report_case_count(capsys) -> None:
    with capsys.disabled():
        print(f"\nconfig fuzzing: {CASES['n']} command lines, {CASES['planned']} planned, "
              f"{CASES['refused']} refused with a named key")
