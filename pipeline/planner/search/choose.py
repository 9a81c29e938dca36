"""`plan=auto`: choose schedule, partitioner, micro-batch count, stages per rank and recomputation
together, by planning and simulating every combination on the measured profile.

Why jointly: the best split depends on the schedule (a V placement pairs the first and last
stages on one rank), the best schedule on the micro-batch count (zero-bubble needs m >= 2p) and
all of them on memory (GPipe holds every micro-batch, interleaving doubles the messages). Each
candidate is one pure planning call plus one simulation, so the search is the planner run many
times, and its table says in numbers why the winner won. Candidates the per-device budget rules
out are kept with the device and bytes that broke it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plugins import Plugin
from pipelaunch.pipeline.planner.predict.memory import MIB, BudgetExceeded, DeviceMemory, budget_message
from pipelaunch.pipeline.planner.predict.prediction import Prediction


@dataclass(frozen=True)
class Candidate:
    """One configuration the search plans: scheduler option (with its settings), partitioner
    option, micro-batches per step and replica, remat, the data-parallel sharding level when
    the search tries levels (`plan.zero`; None: the configured `zero`), and the layout when it
    tries layouts (`plan.devices`; None: the configured pp and dp)."""

    scheduler: str
    scheduler_plugin: Plugin
    partitioner: str
    partitioner_plugin: Plugin
    microbatches: int
    remat: str
    zero: int | None = None
    pp: int | None = None
    dp: int | None = None
    #: zero=3's release point when the search tries them (`plan.reshard`; None: the configured one)
    reshard: str | None = None
    #: the tensor-parallel degree of the layout under plan.devices (None: the configured tp)
    tp: int | None = None
    #: the expert-parallel degree of the layout under plan.devices on a model with routed experts
    #: (None: the configured ep)
    ep: int | None = None
    #: the context-parallel degree of the layout under a plan.devices search over cp (None: the
    #: configured cp)
    cp: int | None = None

    @property
    def label(self) -> str:
        level = ("" if self.zero is None else f" / zero={self.zero}") + \
            ("" if self.reshard is None else f" reshard={self.reshard}")
        layout = "" if self.pp is None else f" / {self.layout_text}"
        return f"{self.scheduler} / {self.partitioner} / {self.microbatches} mbs / remat={self.remat}{level}{layout}"

    @property
    def level(self) -> int:
        """The sharding level for ranking (the configured one counts as 0: it is not compared)."""
        return self.zero or 0

    def overrides(self) -> dict:
        """The config keys this candidate sets."""
        return {"scheduler": dict(self.scheduler_plugin.config), "partitioner": dict(self.partitioner_plugin.config),
                "microbatches": self.microbatches, "remat": self.remat,
                **({} if self.zero is None else {"zero": self.zero}),
                **({} if self.reshard is None else {"reshard": self.reshard}), **self.layout()}

    def layout(self) -> dict:
        """{"pp": .., "dp": .., "tp": ..} when the search tries layouts (`plan.devices`), with "ep"
        when it tries expert-parallel degrees and "cp" context-parallel ones, else {}."""
        if self.pp is None:
            return {}
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp or 1, **({} if self.ep is None else {"ep": self.ep}),
                **({} if self.cp is None else {"cp": self.cp})}

    @property
    def layout_text(self) -> str:
        """`pp=2 dp=2`, `pp=2 dp=1 tp=2`, `pp=16 dp=128 ep=64`, `pp=16 dp=8 tp=8 cp=16`: the layout
        as its overrides name it."""
        return f"pp={self.pp} dp={self.dp}" + (f" tp={self.tp}" if self.tp and self.tp > 1 else "") + \
            (f" ep={self.ep}" if self.ep and self.ep > 1 else "") + (f" cp={self.cp}" if self.cp and self.cp > 1 else "")

    @property
    def devices(self) -> int:
        """The ranks of its layout: pp x dp x tp x cp (its configured axes counting 1)."""
        return (self.pp or 1) * (self.dp or 1) * (self.tp or 1) * (self.cp or 1)


@dataclass
class Outcome:
    candidate: Candidate
    prediction: Prediction | None = None
    #: devices over the budget (the candidate does not fit)
    over: list[DeviceMemory] = field(default_factory=list)
    #: why the candidate could not be planned at all (a schedule's rule, too few blocks, ...)
    error: str | None = None
    #: no split of it fits the budget (a stage alone is over the cap, before any schedule is simulated)
    split_over: str | None = None
    #: the screen's closed-form estimate that put it among those planned, if any (a `screen.Estimate`:
    #: search/screen.py builds on this module)
    estimate: Any = None

    @property
    def fits(self) -> bool:
        return self.prediction is not None and not self.over and self.error is None and self.split_over is None

    def row(self) -> dict:
        """A JSON row for metrics.json / prediction.json."""
        row: dict = {"label": self.candidate.label, "scheduler": self.candidate.scheduler,
                     "partitioner": self.candidate.partitioner, "microbatches": self.candidate.microbatches,
                     "remat": self.candidate.remat, **({} if self.candidate.zero is None else
                                                        {"zero": self.candidate.zero}),
                     **({} if self.candidate.reshard is None else {"reshard": self.candidate.reshard}),
                     **self.candidate.layout()}
        if self.prediction is not None:
            res = self.prediction.result
            row.update(step_s=res.makespan_s, bubble=res.mean_bubble,
                       device_peak_bytes=[d.total for d in self.prediction.devices])
        if self.estimate is not None and self.estimate.error is None:  # how far the screen was off
            row.update(estimated_step_s=self.estimate.step_s, estimated_peak_bytes=self.estimate.peak_bytes)
        if self.over:
            row["over_budget"] = [d.to_dict() for d in self.over]
        if self.split_over:
            row["over_budget"] = self.split_over
        if self.error:
            row["error"] = self.error
        return row


@dataclass
class SearchResult:
    outcomes: list[Outcome]
    seconds: float
    cap: float | None
    #: the candidate the user's own config names, when it is among them
    given: Candidate | None = None
    #: candidates predicted within this share of the fastest count as tied (the predictions hold to
    #: about this much); among them the one cut into the fewest stages runs, then the lowest level,
    #: the fewest micro-batches, and the one holding the least on its fullest device
    tie: float = 0.0
    #: on a hardware file: an outcome's (tokens per second per device, model FLOPs utilisation)
    per_device: Callable[[Outcome], tuple[float, float]] | None = None
    #: candidates not simulated, with their closed-form estimates (search/screen.py): a search with
    #: more candidates than `plan.simulate` plans only the most promising
    screened: list = field(default_factory=list)
    #: what the simulated candidates' activations came to over their estimates' (>= 1): the
    #: estimates left out as over the memory are judged with it
    activation_scale: float = 1.0
    #: under ep: an outcome's (routed experts' bytes on its fullest device, seconds its busiest
    #: rank spends in the all-to-alls of a step), for the reasons `why` gives
    experts_of: Callable[[Outcome], tuple[float, float]] | None = None

    @property
    def ranked(self) -> list[Outcome]:
        """Candidates that fit, fastest first (ties: the lower sharding level, the lower fullest-device
        peak, then fewer micro-batches)."""
        fits = [o for o in self.outcomes if o.fits]
        return sorted(fits, key=lambda o: (o.prediction.step_s, o.candidate.level, o.prediction.peak_bytes,
                                           o.candidate.microbatches))

    @property
    def excluded(self) -> list[Outcome]:
        """Over the budget: simulated ones fastest first (with the devices over it), then those no
        split of which fits."""
        simulated = sorted((o for o in self.outcomes if o.over), key=lambda o: o.prediction.step_s)
        return simulated + [o for o in self.outcomes if o.split_over]

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    @property
    def winner(self) -> Outcome:
        ranked = self.ranked
        if not ranked:
            raise ConfigError("plan", self._nothing_fits())
        # Fewest stages first: each stage adds transfers and switches between stages that the
        # predictions price least well (interleaved 1F1B at pp=2 measured 1.06-1.13x its prediction in
        # four runs, median 1.10, with 4 stages per rank 1.13x; one or two stages per rank 0.94-1.10x,
        # median 1.03). Then the lowest sharding level: a higher one adds collectives (gathers,
        # reduce-scatters) the simulator does not price yet, so its equal prediction is optimistic.
        # Then the fewest micro-batches, for the reason stages come first: gpt_bench's zb_h2 at 8
        # measured 3-7% slower than at 4 where the simulator put it up to 5% ahead. Only then the
        # least memory: every tied candidate fits the budget.
        return min(self._tied(ranked), key=lambda o: (_stages(o), o.candidate.level, o.candidate.microbatches,
                                                      o.prediction.peak_bytes, o.prediction.step_s))

    def _tied(self, ranked: list[Outcome]) -> list[Outcome]:
        """The fits predicted within `tie` of the fastest."""
        return [o for o in ranked if o.prediction.step_s <= ranked[0].prediction.step_s * (1 + self.tie)]

    def _nothing_fits(self) -> str:
        msg = f"plan=auto found no configuration that runs ({len(self.outcomes)} tried)"
        simulated = [o for o in self.excluded if o.over]
        if simulated:
            best = min(simulated, key=lambda o: o.prediction.peak_bytes)  # the closest to fitting
            tried_remat = any(o.candidate.remat == "auto" for o in self.outcomes)
            msg += (f"; {len(self.excluded)} were over memory.cap_bytes, the closest {best.candidate.label}: "
                    f"{budget_message(best.over, self.cap or 0)}. Raise memory.cap_bytes"
                    + (", or use more stages (pp)" if tried_remat else " or add auto to plan.remat"))
        elif self.excluded:
            msg += f"; {len(self.excluded)} had no split within memory.cap_bytes, e.g. " \
                   f"{self.excluded[0].candidate.label}: {_first_sentence(self.excluded[0].split_over or '')}"
        if self.failed:
            msg += f"; {len(self.failed)} could not be planned, e.g. {self.failed[0].candidate.label}: " \
                   f"{self.failed[0].error}"
        return msg

    def table(self, top: int = 10) -> str:
        """The fastest candidates that fit, then those over the budget and those that could not be planned."""
        cap = f" (cap {self.cap / MIB:.1f})" if self.cap is not None else ""
        width = max([8, *(len(o.candidate.scheduler) for o in self.ranked[:top])])
        levels = any(o.candidate.zero is not None for o in self.outcomes)  # the search tries levels
        layouts = any(o.candidate.pp is not None for o in self.outcomes)  # ... and layouts (plan.devices)
        tps = any((o.candidate.tp or 1) > 1 for o in self.outcomes)  # ... and tensor-parallel degrees
        eps = any((o.candidate.ep or 1) > 1 for o in self.outcomes)  # ... and expert-parallel degrees
        cps = any((o.candidate.cp or 1) > 1 for o in self.outcomes)  # ... and context-parallel degrees
        lines = [f"{'#':>3}  {'schedule':<{width}} {'partitioner':<11} {'mbs':>4} {'remat':<5} "
                 + (f"{'zero':>4} " if levels else "") + (f"{'pp':>3} {'dp':>3} " if layouts else "")
                 + (f"{'tp':>3} " if tps else "") + (f"{'ep':>3} " if eps else "") + (f"{'cp':>3} " if cps else "")
                 + f"{'step ms':>9} {'bubble':>7} " + (f"{'tok/s/dev':>9} {'MFU':>6} " if self.per_device else "")
                 + f" peak MiB per device{cap}"]
        for i, o in enumerate(self.ranked[:top], 1):
            c, p = o.candidate, o.prediction
            mark = "  <- runs" if o is self.winner else ""
            lines.append(f"{i:>3}  {c.scheduler:<{width}} {c.partitioner:<11} {c.microbatches:>4} {c.remat:<5} "
                         + (f"{c.level:>4} " if levels else "") + (f"{c.pp:>3} {c.dp:>3} " if layouts else "")
                         + (f"{c.tp or 1:>3} " if tps else "") + (f"{c.ep or 1:>3} " if eps else "")
                         + (f"{c.cp or 1:>3} " if cps else "")
                         + f"{p.step_s * 1e3:>9.1f} {p.result.mean_bubble:>7.1%} " + self._figures(o)
                         + f" {_devices(p.devices)}{mark}")
        hidden = len(self.ranked) - top
        if hidden > 0:
            lines.append(f"     ... and {hidden} slower candidates that fit")
        if self.excluded:
            lines.append(f"over the budget ({len(self.excluded)}):")
            lines += [f"     {o.candidate.label} ({o.prediction.step_s * 1e3:.1f} ms): {budget_message(o.over, self.cap)}"
                      if o.over else f"     {o.candidate.label}: {_first_sentence(o.split_over or '')}"
                      for o in self.excluded[:top]]
        if self.failed:
            lines.append(f"could not be planned ({len(self.failed)}):")
            lines += [f"     {o.candidate.label}: {_first_sentence(o.error or '')}" for o in self.failed[:top]]
        if self.screened:
            lines.append(self._screened_line())
        return "\n".join(lines)

    def _screened_line(self) -> str:
        """How many candidates the closed-form estimate left unsimulated, and why."""
        scale = self.activation_scale
        over = sum(1 for _, e in self.screened if e.error is None and not e.fits(self.cap, scale))
        failed = sum(1 for _, e in self.screened if e.error is not None)
        slower = len(self.screened) - over - failed
        best = min((e.step_s for _, e in self.screened if e.error is None and e.fits(self.cap, scale)), default=None)
        scaled = f", activations x{scale:.2f} as the simulated ones held" if scale > 1.0 else ""
        return (f"{len(self.outcomes)} of {len(self.outcomes) + len(self.screened)} candidates simulated; the rest by "
                f"closed-form estimate: {slower} slower" + (f" (the fastest of them estimated at {best * 1e3:.1f} ms)"
                                                               if best is not None else "")
                + f", {over} over the device memory{scaled}, {failed} that cannot run (plan.simulate sets how many "
                  "run)")

    def _figures(self, o: Outcome) -> str:
        if self.per_device is None:
            return ""
        tokens, mfu = self.per_device(o)
        return f"{tokens:>9.0f} {mfu:>6.1%} "

    def why(self) -> str:
        """Why the winner won, in numbers: against the runner-up with another schedule, the
        config as given, and any faster candidate the budget ruled out."""
        win = self.winner
        wp = win.prediction
        parts = [f"{win.candidate.label} is predicted at {wp.step_s * 1e3:.1f} ms per step "
                 f"(bubble {wp.result.mean_bubble:.1%}, fullest device {wp.peak_bytes / MIB:.1f} MiB)"]
        fastest = self.ranked[0]
        if fastest is not win:
            fp = fastest.prediction
            tied = f"the fastest prediction, {fastest.candidate.label} ({fp.step_s * 1e3:.1f} ms), is within " \
                   f"the {self.tie:.0%} the predictions hold to"
            if _stages(fastest) > _stages(win):
                parts.append(f"{tied}, and cuts the model into {_stages(fastest)} stages against {_stages(win)} "
                             "(among tied candidates the fewest stages run: the predictions hold least well for "
                             "many stages per rank)")
            elif fastest.candidate.level > win.candidate.level:
                parts.append(f"{tied}, and shards more (zero={fastest.candidate.level} against "
                             f"zero={win.candidate.level}: among tied candidates the lowest level runs, since the "
                             "predictions do not price its collectives yet)")
            elif fastest.candidate.microbatches > win.candidate.microbatches:
                parts.append(f"{tied}, and cuts the batch into {fastest.candidate.microbatches} micro-batches against "
                             f"{win.candidate.microbatches} (among tied candidates the fewest micro-batches run: "
                             "each adds actions and messages that cost more on the machine than the "
                             "predictions price)")
            else:
                parts.append(f"{tied}, and holds {(fp.peak_bytes - wp.peak_bytes) / MIB:.1f} MiB more on its fullest "
                             f"device ({fp.peak_bytes / MIB:.1f} MiB)")
        rest = [o for o in self.ranked if o is not win]
        other = next((o for o in rest if o.candidate.scheduler != win.candidate.scheduler), None)
        if other is not None and other is not fastest:  # the fastest one was named just above
            op = other.prediction
            parts.append(f"{_faster(op.step_s, wp.step_s)} the best other schedule, {other.candidate.label} "
                         f"({op.step_s * 1e3:.1f} ms, bubble {op.result.mean_bubble:.1%})")
        same = next((o for o in rest if o.candidate.scheduler == win.candidate.scheduler
                     and o.candidate.partitioner != win.candidate.partitioner), None)
        parts += _level_reasons(win, self.ranked, self.excluded) + self._expert_reasons(win) + \
            _layout_reasons(win, self.outcomes) + self._context_reasons(win)
        if same is not None:
            parts.append(f"{_faster(same.prediction.step_s, wp.step_s)} the same schedule split by "
                         f"{same.candidate.partitioner} ({same.prediction.step_s * 1e3:.1f} ms)")
        given = next((o for o in self.outcomes if o.candidate == self.given), None) if self.given else None
        if given is not None and given is not win:
            if given.fits:
                parts.append(f"{_faster(given.prediction.step_s, wp.step_s)} the configuration as given "
                             f"({given.candidate.label}, {given.prediction.step_s * 1e3:.1f} ms)")
            elif given.over:
                parts.append(f"the configuration as given ({given.candidate.label}) is over the budget")
        faster_over = [o for o in self.excluded if o.over and o.prediction.step_s < wp.step_s]
        if faster_over:
            o = faster_over[0]
            parts.append(f"{len(faster_over)} faster candidate(s) did not fit the budget, the fastest "
                         f"{o.candidate.label} at {o.prediction.step_s * 1e3:.1f} ms: {budget_message(o.over, self.cap)}")
        return "; ".join(parts) + "."

    def _expert_reasons(self, win: Outcome) -> list[str]:
        """Under ep: why the winner's expert-parallel degree, against the other degrees of its
        layout (pp, dp, tp): their best planned candidate (step, experts held, all-to-all time), or
        what their estimates said when none was planned."""
        c = win.candidate
        if c.ep is None:
            return []
        same = [o for o in self.outcomes if (o.candidate.pp, o.candidate.dp, o.candidate.tp) == (c.pp, c.dp, c.tp)
                and o.candidate.ep != c.ep]
        layout = (c.pp, c.dp, c.tp)
        screened = [(cand, e) for cand, e in self.screened
                    if (cand.pp, cand.dp, cand.tp) == layout and cand.ep != c.ep and e.error is None]
        if not same and not screened:
            return []

        def facts(o: Outcome) -> str:
            if self.experts_of is None:
                return ""
            if (o.candidate.ep or 1) == 1:
                return "every expert of its layers on each device, no all-to-alls"
            held, exchange = self.experts_of(o)
            return (f"{held / MIB:.1f} MiB of routed-expert parameters on the fullest device, all-to-alls "
                    f"{exchange * 1e3:.1f} ms of its step")

        text = f"ep={c.ep}" + (f" ({facts(win)})" if self.experts_of else "")
        others = []
        for ep in sorted({o.candidate.ep for o in same} | {cand.ep for cand, _ in screened}):
            fits = [o for o in same if o.candidate.ep == ep and o.fits]
            if fits:
                best = min(fits, key=lambda o: o.prediction.step_s)
                others.append(f"{_faster(best.prediction.step_s, win.prediction.step_s)} ep={ep} "
                              f"({best.prediction.step_s * 1e3:.1f} ms" + (f", {facts(best)})" if self.experts_of
                                                                           else ")"))
                continue
            over = [o for o in same if o.candidate.ep == ep and (o.over or o.split_over)]
            estimates = [e for cand, e in screened if cand.ep == ep]
            if over:
                others.append(f"ep={ep} is over the device memory")
            elif estimates:
                fitting = [e for e in estimates if e.fits(self.cap, self.activation_scale)]
                if fitting:
                    others.append(f"ep={ep} is estimated at best at {min(e.step_s for e in fitting) * 1e3:.1f} ms "
                                  "(not planned)")
                else:
                    least = min(estimates, key=lambda e: e.peak_bytes)
                    others.append(f"ep={ep} is estimated over the device memory in every candidate (the least "
                                  f"{least.peak_bytes / MIB:.1f} MiB)")
        if not others:
            return []
        return [f"{text} against the same layout's other expert-parallel degrees: " + ", ".join(others)]

    def _context_reasons(self, win: Outcome) -> list[str]:
        """Under a search over cp (`plan.cp`): why the winner's context-parallel degree, against
        each other degree at its best (any layout of it): planned (its step and fullest device),
        over the device memory, or what its estimates said when none was planned."""
        c = win.candidate
        degrees = {o.candidate.cp for o in self.outcomes} | {cand.cp for cand, _ in self.screened}
        if c.cp is None:
            return []
        if degrees == {1}:
            return ["cp=1 is the only context-parallel degree searched (plan.cp's default splits a sequence only "
                    "while each rank keeps 8192 positions or more; list degrees in plan.cp to compare them)"]
        mine = (f"cp={c.cp} (each sequence over {c.cp} ranks, a rank holding 1/{c.cp} of its positions' activations"
                f"; fullest device {win.prediction.peak_bytes / MIB:.1f} MiB)" if c.cp > 1 else
                "cp=1 (each sequence whole on a rank: no attention exchanges)")
        others = []
        for cp in sorted(degrees - {None, c.cp}):
            own = [o for o in self.outcomes if o.candidate.cp == cp]
            fits = [o for o in own if o.fits]
            if fits:
                best = min(fits, key=lambda o: o.prediction.step_s)
                others.append(f"{_faster(best.prediction.step_s, win.prediction.step_s)} cp={cp} at its best "
                              f"({best.candidate.layout_text}, {best.prediction.step_s * 1e3:.1f} ms, fullest device "
                              f"{best.prediction.peak_bytes / MIB:.1f} MiB)")
                continue
            estimates = [e for cand, e in self.screened if cand.cp == cp and e.error is None]
            fitting = [e for e in estimates if e.fits(self.cap, self.activation_scale)]
            if any(o.over or o.split_over for o in own) and not fitting:
                others.append(f"cp={cp} is over the device memory")
            elif fitting:
                others.append(f"cp={cp} is estimated at best at {min(e.step_s for e in fitting) * 1e3:.1f} ms "
                              "(not planned)")
            elif estimates:
                least = min(estimates, key=lambda e: e.peak_bytes)
                others.append(f"cp={cp} is estimated over the device memory in every candidate (the least "
                              f"{least.peak_bytes / MIB:.1f} MiB)")
            else:
                others.append(f"cp={cp}: none of its candidates can run")
        return [f"{mine} against the other context-parallel degrees: " + ", ".join(others)] if others else []

    def to_dict(self, top: int = 20) -> dict:
        return {"seconds": self.seconds, "candidates": len(self.outcomes), "screened": len(self.screened),
                "activation_scale": self.activation_scale,
                "fit": len(self.ranked),
                "over_budget": len(self.excluded), "failed": len(self.failed), "winner": self.winner.row(),
                "why": self.why(), "top": [o.row() for o in self.ranked[:top]],
                "excluded": [o.row() for o in self.excluded], "errors": [o.row() for o in self.failed]}


def _devices(devices: Sequence[DeviceMemory]) -> str:
    """Each device's peak in MiB; many devices: the fullest and how many there are."""
    if len(devices) <= 8:
        return " / ".join(f"{d.total / MIB:.1f}" for d in devices)
    return f"max {max(d.total for d in devices) / MIB:.1f} over {len(devices)} ranks"


def _faster(other_s: float, own_s: float) -> str:
    """How a step of `own_s` compares with one of `other_s`."""
    gain = other_s / own_s - 1 if own_s > 0 else 0.0
    if gain > 0.0005:
        return f"{gain:.1%} faster than"
    return f"{own_s / other_s - 1:.1%} slower than" if gain < -0.0005 else "as fast as"


def _level_reasons(win: Outcome, ranked: Sequence[Outcome], excluded: Sequence[Outcome]) -> list[str]:
    """Why the winner's sharding level: lower levels of its configuration over the budget, higher
    ones that fit too but run only on a tie (their collectives are not priced yet)."""
    same = [o for o in (*ranked, *excluded) if o is not win and _same_but_level(o.candidate, win.candidate)]
    lower = [o.candidate.level for o in same if (o.over or o.split_over) and o.candidate.level < win.candidate.level]
    higher = [o.candidate.level for o in same if o.fits and o.candidate.level > win.candidate.level]
    out = []
    if lower:
        out.append(f"lower sharding levels of it ({', '.join(f'zero={z}' for z in sorted(lower))}) are over the budget")
    if higher:
        out.append(f"higher ones ({', '.join(f'zero={z}' for z in sorted(higher))}) fit too, but the lowest level that "
                   "fits runs: the predictions do not price the collectives a higher level adds yet")
    return out


def _same_but_level(a: Candidate, b: Candidate) -> bool:
    return (a.scheduler, a.partitioner, a.microbatches, a.remat, a.pp, a.dp, a.tp, a.ep, a.cp, a.reshard) == (
        b.scheduler, b.partitioner, b.microbatches, b.remat, b.pp, b.dp, b.tp, b.ep, b.cp, b.reshard)


def _layout_reasons(win: Outcome, outcomes: Sequence[Outcome]) -> list[str]:
    """Under `plan.devices`: which layouts were compared (the configured pp and dp are not used),
    and the best fitting candidate of each other layout against the winner."""
    c = win.candidate
    if c.pp is None:
        return []
    by_layout: dict[str, list[Outcome]] = {}
    for o in sorted(outcomes, key=lambda o: (o.candidate.cp or 1, o.candidate.tp or 1, o.candidate.pp, o.candidate.dp,
                                             o.candidate.ep or 1)):
        by_layout.setdefault(o.candidate.layout_text, []).append(o)
    devices = c.devices
    out = [f"plan.devices={devices} compared the layouts {', '.join(by_layout)} "
           f"(the configured pp and dp are not used) and runs {c.layout_text}"]
    for text, own in by_layout.items():
        if text == c.layout_text:
            continue
        fits = [o for o in own if o.fits]
        if fits:
            best = min(fits, key=lambda o: o.prediction.step_s)
            out.append(f"{_faster(best.prediction.step_s, win.prediction.step_s)} {text} at its best "
                       f"({best.candidate.label}, {best.prediction.step_s * 1e3:.1f} ms)")
        else:
            why = "none of its candidates could be planned" if all(o.error for o in own) else \
                "none of its candidates fits the budget"
            out.append(f"{text}: {why}")
    return out


def _stages(outcome: Outcome) -> int:
    return len(outcome.prediction.plan.stages)


def _first_sentence(text: str) -> str:
    text = text.removeprefix("Invalid config ")
    return text if len(text) <= 200 else text[:197] + "..."


def microbatch_counts(pp: int, dp: int, batch_size: int, given: int, wanted: Sequence[int] | None,
                      smallest: bool = False) -> list[int]:
    """The micro-batch counts to try: `wanted`, or pp, 2pp, 4pp and 8pp (and the count given)
    among those that split each replica's batch evenly; with `smallest` (a cluster's layouts,
    plan.devices) also micro-batches of one sequence, the smallest bubble, as large models are
    run (a size the screen prices anyway: its smallest), and 3pp and 6pp. Micro-batches of two
    sequences for every layout gave the SC21 search two rows more but cost the Llama-70B search an
    export per tp degree (112 s against 75 s)."""
    per_replica = batch_size // dp
    pool = list(wanted) if wanted else [pp, 2 * pp, 4 * pp, 8 * pp, given]
    if smallest and not wanted:  # Megatron's counts are the batch over its micro-batch, not a power of two
        pool += [3 * pp, 6 * pp, per_replica]
    if not all(isinstance(m, int) and not isinstance(m, bool) for m in pool):
        raise ConfigError("plan.microbatches", f"got {wanted!r}; valid: a list of positive integers, or null")
    counts = sorted({m for m in pool if m >= 1 and per_replica % m == 0})
    if not counts:
        raise ConfigError("plan.microbatches", f"none of {sorted(set(pool))} divides the {per_replica} sequences "
                                               f"of a replica (batch_size={batch_size} / dp={dp}); list counts that do")
    return counts


def remat_values(wanted: Sequence[str] | None, capped: bool) -> list[str]:
    """The remat values to try: `wanted` (default none and auto), auto only under a budget."""
    from pipelaunch.pipeline.planner.schedules import REMAT_CHOICES

    values = list(wanted) if wanted else ["none", "auto"]
    bad = [v for v in values if v not in REMAT_CHOICES]
    if bad:
        raise ConfigError("plan.remat", f"got {bad}; valid: a list of {', '.join(REMAT_CHOICES)}")
    return [v for v in values if v != "auto" or capped] or ["none"]


def zero_levels(wanted: Sequence[int] | None, dp: int) -> list[int | None]:
    """The sharding levels to try: `wanted` (`plan.zero`), or [None], the configured level only
    (labels then leave the level out). A level above 0 needs dp >= 2, as `zero` does."""
    if wanted is None:
        return [None]
    levels = list(wanted)
    if not levels or not all(isinstance(z, int) and not isinstance(z, bool) and 0 <= z <= 3 for z in levels):
        raise ConfigError("plan.zero", f"got {wanted!r}; valid: a list of levels in 0..3 (e.g. [0, 1, 2, 3]), or null")
    if dp < 2 and any(levels):
        raise ConfigError("plan.zero", f"levels {sorted(z for z in levels if z)} shard over the data-parallel "
                                       f"replicas, and dp={dp} has one; set dp >= 2 or plan.zero=[0]")
    return sorted(set(levels))


def scheduler_variants(options: Mapping[str, Plugin], wanted: Sequence[str] | None,
                       variants: Mapping[str, Mapping[str, Sequence]] | None) -> list[tuple[str, Plugin]]:
    """(label, option) per scheduler option to try: the options named in `wanted` (all when None),
    each once per combination of the values its `variants` entry lists (e.g. interleaved_1f1b with
    stages_per_rank 2 and 4)."""
    names = list(wanted) if wanted else sorted(options)
    unknown = [n for n in names if n not in options]
    if unknown:
        raise ConfigError("plan.schedulers", f"unknown scheduler option(s) {unknown}; valid: {sorted(options)}")
    out = []
    for name in names:
        base = options[name]
        grid = dict((variants or {}).get(name) or {})
        if not grid:
            out.append((name, base))
            continue
        keys = sorted(grid)
        for values in itertools.product(*(list(grid[k]) for k in keys)):
            label = f"{name}({', '.join(f'{k}={v}' for k, v in zip(keys, values, strict=True))})"
            out.append((label, base.with_settings(label, **dict(zip(keys, values, strict=True)))))
    return out


def candidates(
    schedulers: Sequence[tuple[str, Plugin]],
    partitioners: Mapping[str, Plugin],
    counts: Sequence[int],
    remats: Sequence[str],
    zeros: Sequence[int | None] = (None,),
    layout: tuple[int | None, int | None] = (None, None),
    reshards: Sequence[str | None] = (None,),
    configured_zero: int = 0,
    tp: int | None = None,
    ep: int | None = None,
    cp: int | None = None,
) -> list[Candidate]:
    """Every combination, in a fixed order; `layout`: the (pp, dp) they all run at (None: the
    configured ones); `reshards`: zero=3's release points to try, for the candidates at zero=3
    (`configured_zero`: the level of those the search does not set)."""
    return [Candidate(s, sched, p, part, m, r, z, *layout, reshard=h, tp=tp, ep=ep, cp=cp)
            for (s, sched), (p, part), m, r, z in itertools.product(schedulers, partitioners.items(), counts, remats,
                                                                    zeros)
            for h in (reshards if (configured_zero if z is None else z) == 3 else (None,))]


def reshard_values(wanted: Sequence[str] | None) -> list[str | None]:
    """zero=3's release points to try: `wanted` (`plan.reshard`), or [None], the configured one."""
    if wanted is None:
        return [None]
    values = [str(v) for v in wanted]
    if not values or any(v not in ("use", "run") for v in values):
        raise ConfigError("plan.reshard", f"got {list(wanted)!r}; valid: a list of use and run (e.g. [use, run]), "
                                          "or null")
    return sorted(set(values), key=("use", "run").index)


def run_search(
    cands: Sequence[Candidate],
    evaluate: Callable[[Candidate], Prediction],
    cap: float | None,
    given: Candidate | None = None,
    tie: float = 0.0,
    started: float | None = None,
) -> SearchResult:
    """Plan and simulate every candidate; a budget overrun or a config the candidate cannot run is
    recorded, not raised. `started`: when the search began (its profiling included), else now."""
    start = time.perf_counter() if started is None else started
    outcomes = []
    for cand in cands:
        try:
            outcomes.append(Outcome(cand, evaluate(cand)))
        except BudgetExceeded as err:
            outcomes.append(Outcome(cand, err.prediction, over=err.devices))
        except ConfigError as err:
            if err.key == "memory.cap_bytes":  # a partitioner found no split within the cap
                outcomes.append(Outcome(cand, split_over=str(err)))
            else:
                outcomes.append(Outcome(cand, error=str(err)))
    for o in outcomes:  # an overrun without a prediction cannot be ranked among the exclusions
        if o.over and o.prediction is None:
            o.error, o.over = budget_message(o.over, cap or 0), []
    return SearchResult(outcomes, time.perf_counter() - start, cap, given, tie)
