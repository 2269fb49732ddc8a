"""Running under ``torchrun``: one process per device, ``torch.distributed`` underneath.

vizq uses the engine its users already launch, not a process pool of its own: ``torchrun``
sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and the rendezvous, :func:`context` joins the
process group (``gloo`` on CPU, ``nccl`` on CUDA, chosen from the device) and picks this
rank's device. Without those variables everything runs as a single process (rank 0 of 1).

Only rank 0 prints progress and writes files; every write happens after the last collective
has succeeded, so a rank that fails leaves nothing partial behind (torchrun then stops the
others).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as tdist

T = TypeVar("T")


@dataclass(frozen=True)
class Context:
    """Where this process stands: its rank, the world size and its device."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints and writes."""
        return self.rank == 0


def launched() -> bool:
    """True when started by torchrun (or another launcher that sets the env:// variables)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def context(device: str = "auto") -> Context:
    """Join the process group if launched with several processes; pick this rank's device.

    ``device='auto'``: CUDA device ``LOCAL_RANK`` when CUDA is there, else CPU. An explicit
    ``cuda`` becomes ``cuda:LOCAL_RANK``, so each rank drives its own GPU.
    """
    from .device import resolve_device

    dev = resolve_device(device)
    if not launched():
        return Context(device=str(dev))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not tdist.is_initialized():
        tdist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Context(tdist.get_rank(), tdist.get_world_size(), str(dev))


def shard(items: Sequence[T], ctx: Context) -> list[T]:
    """This rank's share: contiguous slices whose sizes differ by at most one, in order, so
    the union over ranks is ``items`` exactly (no overlap, no loss, any remainder)."""
    n, w, r = len(items), ctx.world, ctx.rank
    lo = r * (n // w) + min(r, n % w)
    hi = lo + n // w + (1 if r < n % w else 0)
    return list(items[lo:hi])


def sum_tensor(t: torch.Tensor, ctx: Context) -> torch.Tensor:
    """All-reduce a sum (in place on a copy); the identity for a single process. Runs on the
    CPU for gloo and on this rank's device for nccl."""
    if not ctx.active:
        return t
    dev = ctx.device if ctx.device.startswith("cuda") else "cpu"
    out = t.detach().clone().to(dev)
    tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
    return out.cpu()


def gather_objects(obj: Any, ctx: Context) -> list[Any]:
    """Every rank's ``obj``, in rank order (picklable objects only)."""
    if not ctx.active:
        return [obj]
    out: list[Any] = [None] * ctx.world
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, ctx: Context) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.active:
        return obj
    box = [obj if ctx.main else None]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: Context) -> None:
    if ctx.active:
        tdist.barrier()


def finish(ctx: Context) -> None:
    """Leave the process group (torchrun expects a clean exit)."""
    if ctx.active and tdist.is_initialized():
        tdist.destroy_process_group()
