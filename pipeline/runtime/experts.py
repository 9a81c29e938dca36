"""Expert parallelism on a rank (`ep > 1`): each mixture-of-experts layer of its stages keeps its
share of the routed experts, and carries every token to the ranks holding the experts it picked
and the results back.

The ep group is `ep` replicas of this pipeline rank (`pipeline/core/layout.py`): they run the same
program, so every layer's exchanges come in the same order on each of them, on the group's own
communicator, beside the pipeline's P2P and the replicas' reductions (what NCCL needs). Each
layer's dispatch is two all-to-alls, dropless (Megatron's and torchtitan's): the token counts per
(destination rank, its local expert), then the tokens, sorted by expert; its combine is one, the
expert outputs back in the order they came. Their backward runs the same exchanges reversed
(`AllToAll`). The counts are read on the host to size the exchange (a stream sync per layer on a
GPU, as transformers' and torchtitan's dropless dispatch pays).

Why the model's own expert code runs on the received rows (`Experts.compute`): the rank computes
exactly what one process computes for those tokens, whatever the expert is (its activation, its
gate); only where each token's rows are computed changes. The experts' gradients then hold every
replica of the ep group's tokens, and are summed over the expert replicas (the dp / ep ranks
holding the same experts: runtime/dp.py) as every other gradient is over all replicas.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from pipelaunch.models.hf_moe import HFExperts
from pipelaunch.models.list_experts import ListExperts
from pipelaunch.models.moe import Experts
from pipelaunch.pipeline.runtime.overlap import exchange


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows, `send` rows to each rank out and `recv` rows from each in; its
    backward sends the gradients back the same way reversed. Both go through `overlap.exchange`:
    inside DualPipeV's overlapped pair the other action computes while they are in flight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,  # noqa: ANN001
                label: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.label = send, recv, group, label
        out = x.new_empty((sum(recv), *x.shape[1:]))
        exchange(out, x.contiguous(), recv, send, group, label)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        exchange(out, grad.contiguous(), ctx.send, ctx.recv, ctx.group, f"{ctx.label} backward")
        return out, None, None, None, None


class Dispatch:
    """How one layer's experts get their rows under expert parallelism (`Experts.dispatch`):
    called with the layer's (token, expert) rows and their global expert ids, returns each row's
    expert output in the same order. `log`: where the layer's exchanges are recorded
    (debug.record_p2p), as (what, the layer, rows sent, rows received)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, local: int, name: str, log: list | None = None) -> None:
        self.group, self.ep, self.local, self.name, self.log = group, ep, local, name, log

    def __call__(self, experts: Experts, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(index, stable=True)  # by expert, so by the rank holding it
        counts = torch.bincount(index, minlength=self.ep * self.local).view(self.ep, self.local)
        received = torch.empty_like(counts)
        exchange(received, counts, None, None, self.group, f"{self.name} counts")
        send, recv = counts.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        tokens = AllToAll.apply(rows[order], send, recv, self.group, f"{self.name} dispatch")
        local_ids = torch.arange(self.local, device=rows.device).repeat(self.ep).repeat_interleave(received.reshape(-1))
        out = AllToAll.apply(experts.compute(tokens, local_ids), recv, send, self.group, f"{self.name} combine")
        if self.log is not None:
            self.log.append(f"{self.name} dispatch {sum(send)}>{sum(recv)}")
            self.log.append(f"{self.name} combine {sum(recv)}>{sum(send)}")
        back = torch.empty_like(out)
        return back.index_copy(0, order, out)


def expert_modules(modules: list[nn.Module]) -> Iterator[tuple[str, Experts | HFExperts]]:
    """Every routed-experts module of the rank's stages, by its name in the full model: model=gpt's
    and transformers' (model=hf: models/hf_moe.py, the same `compute` / `dispatch` hooks)."""
    for module in modules:
        aliases = getattr(module, "aliases", {})
        seen = set()
        for name, sub in module.named_modules():
            if isinstance(sub, (Experts, HFExperts)) and id(sub) not in seen:
                seen.add(id(sub))
                yield aliases.get(name, name).removeprefix("gm."), sub


def split_experts(modules: list[nn.Module], group: dist.ProcessGroup, ep: int, ep_rank: int,
                  log: list | None = None) -> tuple[set[str], set[str]]:
    """Keep this rank's `experts / ep` consecutive experts of every MoE layer (`keep`: stacked
    parameters cut along the expert dimension, a list of experts cut to its share) and give each
    layer its dispatch. Returns the full-model names of the rank's expert parameters, and of those
    the ones it holds whole (a list's experts; the stacked ones a checkpoint's view puts back whole)."""
    held, whole = set(), set()
    for name, experts in expert_modules(modules):
        if experts.total % ep:
            raise ValueError(f"{name}: {experts.total} experts do not split over ep={ep}")
        local = experts.total // ep
        experts.keep(ep_rank * local, local)
        names = {f"{name}.{n}" for n, _ in experts.expert_parameters()}
        held |= names
        if isinstance(experts, ListExperts):
            whole |= names
        experts.dispatch = Dispatch(group, ep, local, name, log)
    return held, whole


def stop_expert_log(modules: list[nn.Module]) -> None:
    """The first step's exchanges are every step's: stop recording them (debug.record_p2p)."""
    for _, experts in expert_modules(modules):
        if experts.dispatch is not None:
            experts.dispatch.log = None


def expert_holders(gm: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules holding exactly the routed experts' parameters of a stage's graph module, by
    their path in it: an experts module (model=gpt's, transformers' stacked ones) or a list's
    `LocalExperts` (model=module). Under zero >= 1 with 1 < ep < dp each is an FSDP2 unit of its
    own on the expert replicas' mesh (runtime/sharding.py), so it must hold nothing else."""
    out = []
    for path, experts in ((p, m) for p, m in gm.named_modules() if isinstance(m, (Experts, HFExperts))):
        holder, where = experts, path
        if isinstance(experts, ListExperts):
            holder, where = getattr(experts, experts.list_name), f"{path}.{experts.list_name}".lstrip(".")
        mine = {id(p) for _, p in experts.expert_parameters()}
        if {id(p) for p in holder.parameters()} != mine:
            raise ValueError(f"{path}: the experts module holds parameters beside its experts'; zero >= 1 with "
                             "1 < ep < dp shards the experts on a mesh of their own and needs them alone")
        out.append((where, holder))
    return out
