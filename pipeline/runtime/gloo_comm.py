"""FSDP2's gather and reduce-scatter on gloo (CPU) without gloo's full-size temporaries.

Why: torch's gloo backend runs `all_gather_single` through two output-sized temporary buffers and
`reduce_scatter_single` through an input-sized copy, each held until gloo's worker thread drops
its work item, at its own pace after the call has returned. Measured on gpt_bench at zero=3 that
put a rank's tensor peak up to two blocks above what the same step holds on NCCL (whose
collectives work in place), and made it vary from run to run by as much. FSDP2 takes a custom
communication per parameter group (`set_custom_all_gather`, `set_custom_reduce_scatter`), and
both have in-place forms on gloo:

- the gather: FSDP2 has copied this replica's shard into its slot of the output already; one
  broadcast per replica, each from that replica into its slot, fills the rest (the same bytes as
  an all-gather, in place; issued together and waited on as one work);
- the reduce-scatter: an all-reduce of FSDP2's input buffer in place (what gloo's reduce-scatter
  does to its copy), then this replica's part copied out.

Used only where the stages run on a CPU; on a GPU FSDP2's own NCCL collectives run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _PlainAlloc:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class InPlaceAllGather(_PlainAlloc, AllGather):
    """One broadcast per replica into its slot of the output (the own slot holds its shard)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        slots = output_tensor.chunk(group.size())
        works = [dist.broadcast(slot, src=dist.get_global_rank(group, j), group=group, async_op=True)
                 for j, slot in enumerate(slots)]
        if not async_op:
            for work in works:
                work.wait()
            return None
        done = torch.futures.collect_all([w.get_future() for w in works])
        return torch._C._distributed_c10d._create_work_from_future(done)


class InPlaceReduceScatter(_PlainAlloc, ReduceScatter):
    """An all-reduce of the input in place, then this replica's part of it."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
        return None
