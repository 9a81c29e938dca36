"""Micro-batches of their own lengths (#46, `data.buckets`): fine-tuning examples whose lengths
differ tenfold, each micro-batch run at the shortest bucket holding its longest example.

On real gloo ranks in NCCL-semantics mode (tags 0, every pair's posting order and each message's
shape checked at the end, debug.record_p2p), on three schedule families (1f1b, zbv,
interleaved_1f1b) and with two replicas: the losses, step-0 gradients and final weights are one
process's token-weighted run of the user's own model on the whole global batch at model.seq_len
(tests/test_fine_tuning.py's reference, written without pipelaunch's loss or data code beyond the
batch it draws), and the messages the ranks exchanged had the shapes of each micro-batch's bucket:
every rank agreed on them from the data alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from hydra.utils import instantiate

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.lengths import check_buckets, grouped_order, microbatch_lengths, step_lengths
from tests.harness import compose_cfg, merge_state, run_jobs
from tests.test_fine_tuning import MODULE, SEQ, assert_close, module_reference

BUCKETS = [12, 24]
COMMON = ["batch_size=16", "steps=2", "warmup_steps=0", "optimizer=sgd", "optimizer.lr=0.5", "timeout_s=120",
          "threads=1", f"model.seq_len={SEQ}", f"data.buckets=[{','.join(map(str, BUCKETS))}]"]
#: (label, overrides): three schedule families, one with two replicas, all at pp=2 (world 2 or 4)
LAYOUTS = [
    ("1f1b m=8", ["pp=2", "scheduler=1f1b", "microbatches=8"]),
    ("zbv m=8", ["pp=2", "scheduler=zbv", "microbatches=8"]),
    ("interleaved_1f1b m=8", ["pp=2", "scheduler=interleaved_1f1b", "microbatches=8"]),
    ("1f1b dp=2 m=4", ["pp=2", "dp=2", "scheduler=1f1b", "microbatches=4"]),
    ("zbv dp=2 m=4 grouped", ["pp=2", "dp=2", "scheduler=zbv", "microbatches=4", "data.group_by_length=true"]),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    from tests.corpora import make_tokenizer
    from tests.test_fine_tuning import write_examples

    root = tmp_path_factory.mktemp("chat")
    make_tokenizer(root / "tok")
    return ["data=chat", f"data.files=[{write_examples(root / 'train.jsonl')}]", f"data.tokenizer={root / 'tok'}"]


def _forward_shapes(ranks: list) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """Per (sending rank, micro-batch): the shapes of the forward messages it posted (first step)."""
    shapes: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for rank in ranks:
        for entries in rank.extras["posting_log"].values():
            for op, label, shape, _ in entries:
                if op == "send" and label.startswith("F "):
                    mb = int(label.split(" mb")[1].split("#")[0])
                    shapes.setdefault((rank.rank_info.rank, mb), []).append(tuple(shape))
    return shapes


@pytest.mark.timeout(600)
def test_variable_length_microbatches_train_like_one_process_on_three_schedules(corpus, tmp_path) -> None:
    cfgs = {label: compose_cfg([*COMMON, *MODULE, *corpus, *extra]) for label, extra in LAYOUTS}
    runs = {}
    for world in (2, 4):
        labels = [label for label, cfg in cfgs.items() if cfg.pp * cfg.dp == world]
        runs.update(zip(labels, run_jobs([cfgs[k] for k in labels], tmp_path / f"w{world}"), strict=True))
    expected = module_reference(compose_cfg([*COMMON, *MODULE, *corpus, "pp=2", "data.buckets=null"]))
    data = instantiate(cfgs[LAYOUTS[0][0]].data)
    for label, ranks in runs.items():
        cfg = cfgs[label]
        assert ranks[0].losses == pytest.approx(expected["losses"], rel=1e-6), label
        for d in range(cfg.dp):
            grads = {n.removeprefix("inner."): g for n, g in merge_state(ranks, "grads_step0", d).items()}
            params = {n.removeprefix("inner."): p for n, p in merge_state(ranks, "params_final", d).items()}
            assert_close(grads, expected["grads"], f"{label} replica {d} step-0 gradients")
            assert_close(params, expected["params"], f"{label} replica {d} weights after {cfg.steps} steps")
        # the first step's micro-batches ran at lengths of their own, and every forward message
        # had the length of its micro-batch's bucket (the order check compared both ends' shapes)
        m = cfg.microbatches
        grouped = cfg.data["group_by_length"]
        lengths = step_lengths(data.sample_lengths(0, cfg.batch_size), (*BUCKETS, SEQ), cfg.dp, m, grouped)[1]
        assert len(set(lengths)) >= 2 and min(lengths) < SEQ, (label, lengths)
        sent = _forward_shapes(ranks)
        assert sent, f"{label}: no forward message recorded"
        for (rank, mb), shapes in sent.items():
            replica = next(r.rank_info.dp_rank for r in ranks if r.rank_info.rank == rank)
            assert all(s[1] == lengths[replica * m + mb] for s in shapes), (label, rank, mb, shapes)


def test_each_microbatch_runs_at_the_shortest_bucket_holding_its_longest_example() -> None:
    assert check_buckets(None, 48) is None
    assert check_buckets([24, 12, 24], 48) == (12, 24, 48)
    lengths = np.array([3, 12, 13, 5, 40, 2, 1, 24])
    assert microbatch_lengths(lengths, (12, 24, 48), 4) == [12, 24, 48, 24]
    assert microbatch_lengths(lengths, (12, 24, 48), 8) == [12, 12, 24, 12, 48, 12, 12, 24]
    # grouped by length: the same samples, each micro-batch similar lengths, micro-batch j of
    # each of 2 replicas the next similar ones
    order = grouped_order(lengths, 2, 2)
    assert sorted(order) == list(range(8))
    assert lengths[order].tolist() == [1, 2, 12, 13, 3, 5, 24, 40]
    assert step_lengths(lengths, (12, 24, 48), 2, 2, True)[1] == [12, 24, 12, 48]


def test_bad_buckets_are_refused_before_spawn_naming_the_key(corpus) -> None:
    for buckets, says in (("[0,12]", "outside 1..model.seq_len"), ("[12,96]", "outside 1..model.seq_len"),
                          ("abc", "a list of lengths")):
        cfg = compose_cfg([*COMMON, *MODULE, *corpus, "pp=2", f"data.buckets={buckets}"])
        with pytest.raises(ConfigError, match="data.buckets") as err:
            prepare(cfg)
        assert says in str(err.value)
    # transformers' graphs are traced by torch.export, every shape fixed at model.seq_len
    cfg = compose_cfg([*COMMON, "model=hf_llama_tiny", "model.config.vocab_size=320", "model.loss=model",
                       "model.labels=targets", *corpus, "pp=2"])
    with pytest.raises(ConfigError, match="data.buckets") as err:
        prepare(cfg)
    assert "torch.export" in str(err.value)
    cfg = compose_cfg([*COMMON, "model=gpt", "model.vocab_size=320", "model.layers=2", "model.dim=32",
                       "model.heads=2", *corpus, "pp=2", "tp=2"])
    with pytest.raises(ConfigError, match="tp"):
        prepare(cfg)


def test_the_plan_holds_every_boundary_value_at_every_bucket(corpus) -> None:
    """Traced at each length: a boundary value's sequence dimension is the bucket's, the rest as at
    model.seq_len; the plan's JSON keeps them."""
    from pipelaunch.pipeline.core.plan import Plan

    cfg = compose_cfg([*COMMON, *MODULE, *corpus, "pp=2", "microbatches=4"])
    plan = prepare(cfg).plan
    for stage in plan.stages:
        assert sorted(stage.lengths) == [*BUCKETS, SEQ]
        for name, (shape, _) in stage.values.items():
            for length, shapes in stage.lengths.items():
                assert shapes[name] == [shape[0], length, *shape[2:]], (stage.index, name, length)
    assert Plan.from_dict(plan.to_dict()).stages == plan.stages


def test_the_simulator_prices_each_microbatch_at_its_length(corpus) -> None:
    """A micro-batch's compute scales with its length: all at half length, a 1F1B step is half as
    long; one long micro-batch among short ones costs more than all short, less than all long. The
    dry run's prediction of a data.buckets run is that of its own first steps' lengths."""
    from dataclasses import replace

    from pipelaunch.pipeline.planner.placement import linear
    from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate
    from pipelaunch.pipeline.planner.schedules import build_schedule
    from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB

    schedule = build_schedule(OneFOneB(), linear(2), 4)
    cost = CostModel.uniform(2, f=1.0, i=1.0, w=1.0)
    full = simulate(schedule, cost).makespan_s
    assert simulate(schedule, replace(cost, microbatch_scale=[0.5] * 4)).makespan_s == pytest.approx(full / 2)
    mixed = simulate(schedule, replace(cost, microbatch_scale=[0.5, 0.5, 1.0, 0.5])).makespan_s
    assert full / 2 < mixed < full

    prepared = prepare(compose_cfg([*COMMON, *MODULE, *corpus, "pp=2", "microbatches=8", "steps=4"]), profile=True)
    priced = prepared.plan.meta.prediction.variable_lengths
    assert priced["steps_priced"] == 4 and len(priced["step_times_s"]) == 4
    assert priced["longest_step_time_s"] == pytest.approx(prepared.prediction.step_s)
    assert priced["step_time_s"] < priced["longest_step_time_s"]
    assert priced["mean_length"] < SEQ


@pytest.mark.timeout(300)
def test_the_projects_gpt_trains_at_bucket_lengths_as_at_full_length(corpus, tmp_path) -> None:
    """model=gpt (causal attention: a position never reads the padding after it): the same losses
    and weights whether each micro-batch runs at its bucket's length or at model.seq_len."""
    gpt = ["model=gpt", "model.vocab_size=320", "model.layers=2", "model.dim=32", "model.heads=2",
           "model.dropout=0.0", "pp=2", "scheduler=zbv", "microbatches=8"]
    cfgs = [compose_cfg([*COMMON, *gpt, *corpus, *extra]) for extra in ([], ["data.buckets=null"])]
    bucketed, full = run_jobs(cfgs, tmp_path)
    assert bucketed[0].losses == pytest.approx(full[0].losses, rel=1e-6)
    assert_close(merge_state(bucketed, "params_final"), merge_state(full, "params_final"), "gpt weights", rel=1e-5)
