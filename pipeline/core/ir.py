"""Schedules as data: per pipeline rank, an ordered list of actions over (stage, micro-batch).

The same IR feeds the executor, the simulator and the exporters. Generators produce compute
actions only (F, B, I, W, R); `pipelaunch.pipeline.planner.passes.lowering` derives the sends and receives.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class Kind(str, Enum):
    """What an action does."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  input-gradient half of the backward (critical path)
    W = "W"  # weight-gradient half of the backward (deferrable)
    R = "R"  # recompute the forward of a stage whose activations were dropped
    SEND_F = "SEND_F"  # send a stage's outputs to the next stage's rank
    RECV_F = "RECV_F"  # receive a stage's inputs from the previous stage's rank
    SEND_B = "SEND_B"  # send gradients of a stage's inputs to the previous stage's rank
    RECV_B = "RECV_B"  # receive gradients of a stage's outputs from the next stage's rank
    # data-parallel collectives over a stage's replicas (passes/data_parallel.py; dp > 1 only)
    UNSHARD = "UNSHARD"  # gather the stage's sharded parameters (zero >= 1)
    RESHARD = "RESHARD"  # release the gathered parameters, keep the shard (zero >= 1)
    REDUCE_GRAD = "REDUCE_GRAD"  # reduce the stage's gradients over the replicas: all-reduce at
    # zero=0, reduce-scatter into the shard above; started, not waited for (the update waits)


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.R})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
DP_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD})

_TEXT = {k: k.value for k in Kind}
#: a message's arrow before its peer stage: sent to, received from
_ARROW = {Kind.SEND_F: ">", Kind.SEND_B: ">", Kind.RECV_F: "<", Kind.RECV_B: "<"}
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|B|I|W|R)(\d+)"
                        r"(?:([<>])(\d+))?$")


class Action(NamedTuple):
    """One step of a rank's program: `kind` applied to micro-batch `mb` of `stage`.

    A communication action names the stage at the other end (`peer`): it carries the values of
    one stage-graph edge, so it is one message group with one other rank, and the group its peer
    posts is its exact complement (`pipelaunch.pipeline.planner.passes.lowering`)."""

    stage: int
    kind: Kind
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        # torch.distributed.pipelining's compact spelling, e.g. "0F1", "3SEND_B2", with the peer
        # stage of a message after ">" (sent to) or "<" (received from): "2SEND_F0>3", "3RECV_F0<2"
        # (the kinds' texts from a dict: the enum's `value` property costs a call, and a pp=64 plan
        # writes 400k actions)
        if self.peer is None:
            return f"{self.stage}{_TEXT[self.kind]}{self.mb}"
        return f"{self.stage}{_TEXT[self.kind]}{self.mb}{_ARROW[self.kind]}{self.peer}"

    @property
    def torch_name(self) -> str:
        """The spelling of torch.distributed.pipelining, which has no peer: "2SEND_F0"."""
        return f"{self.stage}{self.kind.value}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '0F1' or '2SEND_B3>1')")
        peer = int(match.group(5)) if match.group(5) is not None else None
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)), peer)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


@functools.lru_cache(maxsize=16)
def action_table(kind: Kind, num_stages: int, microbatches: int) -> tuple[Action, ...]:
    """Every `kind` action of a shape, at stage * microbatches + mb: made once and shared (Actions
    are immutable) by the orders and candidates that each write all of them, 65k per kind at pp=64
    with 256 micro-batches."""
    return tuple(Action(s, kind, mb) for s in range(num_stages) for mb in range(microbatches))


def F(stage: int, mb: int) -> Action:  # noqa: N802 - reads like the notation in papers
    return Action(stage, Kind.F, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, Kind.B, mb)


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743
    return Action(stage, Kind.I, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, Kind.W, mb)


def R(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, Kind.R, mb)


@dataclass
class Schedule:
    """A whole pipeline step: which rank runs which actions, in which order.

    `placement[s]` is the pipeline rank (0..pp-1) holding stage `s`; `actions[r]` is rank r's
    program. `training` is False for forward-only (inference) schedules.
    """

    name: str
    num_stages: int
    num_microbatches: int
    placement: list[int]
    actions: list[list[Action]]
    training: bool = True
    lowered: bool = False
    meta: dict = field(default_factory=dict)

    @property
    def pp(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def compute_only(self) -> list[list[Action]]:
        return [[a for a in acts if a.kind in COMPUTE_KINDS] for acts in self.actions]

    def peak_in_flight(self, held: bool = False) -> list[int]:
        """Per stage, the most micro-batches whose activations it holds at once: what a memory
        budget must make room for (1F1B's p - s, GPipe's m, ...). With `held`, micro-batches a
        rematerialised stage keeps only the inputs of count too.

        A rank runs its program in order, so the count is exact whatever the timing: F adds a
        micro-batch (R does instead when the pair is rematerialised), B or W releases it (I keeps
        what W still needs). A forward-only schedule keeps no autograd state: one at a time."""
        if not self.training:
            return [1] * self.num_stages
        remat = set() if held else {(a.stage, a.mb) for acts in self.actions for a in acts if a.kind is Kind.R}
        current = [0] * self.num_stages
        peak = [0] * self.num_stages
        for acts in self.actions:
            for a in acts:
                kind = a.kind
                if (kind is Kind.F and not (remat and (a.stage, a.mb) in remat)) or (kind is Kind.R and not held):
                    current[a.stage] += 1
                    if current[a.stage] > peak[a.stage]:
                        peak[a.stage] = current[a.stage]
                elif kind is Kind.B or kind is Kind.W:
                    current[a.stage] -= 1
        return peak

    def remat_stages(self) -> list[int]:
        """Stages that recompute their forward in the backward (they have R actions)."""
        return sorted({a.stage for acts in self.actions for a in acts if a.kind is Kind.R})

    def grid(self) -> str:
        """One line per rank, compute actions only: a quick human-readable view."""
        texts = [[str(a) for a in acts if a.kind in COMPUTE_KINDS] for acts in self.actions]
        width = max((len(t) for row in texts for t in row), default=3)
        return "\n".join(f"rank {rank}: " + " ".join(t.rjust(width) for t in row) for rank, row in enumerate(texts))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "placement": list(self.placement),
            "actions": [[str(a) for a in acts] for acts in self.actions],
            "training": self.training,
            "lowered": self.lowered,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        return cls(
            name=data["name"],
            num_stages=data["num_stages"],
            num_microbatches=data["num_microbatches"],
            placement=list(data["placement"]),
            actions=[[Action.parse(a) for a in acts] for acts in data["actions"]],
            training=data.get("training", True),
            lowered=data.get("lowered", False),
            meta=dict(data.get("meta", {})),
        )

    def to_csv(self) -> str:
        """torch.distributed.pipelining's CSV format: one row per rank, comma-separated actions."""
        return "\n".join(",".join(a.torch_name for a in acts) for acts in self.actions) + "\n"


def overlapped_pairs(actions: Sequence[Action]) -> set[int]:
    """The positions of the forwards that run as a pair with the action after them: a backward
    (B, or I of a split one) of another stage and micro-batch, as DualPipeV places them in its
    steady state. Another stage's: each stage's replicas reduce and gather on their own, so the
    two sides never share a stage's collectives; another micro-batch's: neither reads the other."""
    pairs: set[int] = set()
    pos = 0
    while pos + 1 < len(actions):
        a, b = actions[pos], actions[pos + 1]
        if a.kind is Kind.F and b.kind in (Kind.B, Kind.I) and a.stage != b.stage and a.mb != b.mb:
            pairs.add(pos)
            pos += 2
        else:
            pos += 1
    return pairs
