"""Collective weight broadcast from the trainer's rank 0 to the inference workers.

The object-store path (WeightRegistry) moves a version GPU -> host -> plasma -> host -> GPU. For a
drafter of the Qwen3-8B shape (0.4-2 GB in bf16 for 1-5 layers) that is over a second, so the GPU-direct
path broadcasts the flat tensors with NCCL straight from the trainer's GPU into the workers' GPUs (gloo
on CPU, the same code), the way OpenRLHF / verl sync weights to their vLLM engines.

The group is a process group of its own, built from a store and ``ProcessGroupNCCL`` /
``ProcessGroupGloo`` directly - not ``init_process_group`` - so it lives beside the trainer's DeepSpeed
default group without touching it. Rank 0 is the sender; ranks 1..N receive. Every rank must call
:meth:`WeightBroadcastGroup.broadcast` for every version, in the same order (a collective).

    g = WeightBroadcastGroup(rendezvous, rank, world_size, device)   # every member, concurrently
    g.broadcast(tensors)                                              # rank 0: sends tensors
    g.broadcast(buffers)                                              # others: fills buffers in place
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["WeightBroadcastGroup"]


class WeightBroadcastGroup:
    """One sender (rank 0) and ``world_size - 1`` receivers of flat tensor dicts.

    Args:
        rendezvous: ``"file:///path"`` (one node: a FileStore, no listening socket) or ``"tcp://host:port"``
            (a TCPStore; rank 0 hosts it).
        rank, world_size: this member; rank 0 sends.
        device: where the tensors live; ``cuda`` -> NCCL, ``cpu`` -> gloo.
        timeout_s: how long a member waits for the others (rendezvous and each broadcast).
    Raises:
        ValueError: rank outside ``[0, world_size)``, ``world_size < 2``, or an unknown rendezvous scheme.
    """

    def __init__(self, rendezvous: str, rank: int, world_size: int, device: torch.device | str,
                 timeout_s: float = 300.0):
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / world_size {world_size}: need world_size >= 2 and 0 <= rank < it")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        if rendezvous.startswith("file://"):
            store = dist.FileStore(rendezvous[len("file://"):], world_size)
        elif rendezvous.startswith("tcp://"):
            host, port = rendezvous[len("tcp://"):].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
        else:
            raise ValueError(f"rendezvous must be file:///path or tcp://host:port, got {rendezvous!r}")
        store = dist.PrefixStore("adaflash_weights", store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # a timed-out broadcast must raise (the caller falls back to the object store), not have the NCCL
            # watchdog tear the whole process down (torch's default, 3): mode 2 aborts the communicator only.
            # Read when this group is built, so the trainer's DeepSpeed group keeps its own setting.
            old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            try:
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            finally:
                if old is None:
                    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
                else:
                    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old
        else:
            if rendezvous.startswith("file://"):  # one node: gloo's own sockets stay on loopback
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.num_broadcasts = 0

    def broadcast(self, tensors: dict[str, torch.Tensor]) -> int:
        """Rank 0: send ``tensors``; other ranks: receive into ``tensors`` (same names, shapes and dtypes,
        on ``device``), in place. One flat buffer per dtype, one collective each. Returns the bytes moved.
        Raises:
            ValueError: a tensor not on this group's device; on every member, when a receiver's tensors differ
                from the sender's (tensors, elements, bytes) - the payload is then skipped by all, in step.
            RuntimeError / DistBackendError: a member is gone (after ``timeout_s``).
        """
        names = sorted(tensors)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in names:
            t = tensors[n]
            if t.device.type != self.device.type:
                raise ValueError(f"tensor {n} is on {t.device}, the group broadcasts on {self.device}")
            by_dtype.setdefault(t.dtype, []).append(n)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        # a manifest first (tensors, elements, bytes), so a receiver whose tensors differ from the sender's
        # fails with a message instead of reading a payload of another size
        mine = torch.tensor([len(names), sum(tensors[n].numel() for n in names),
                             sum(tensors[n].numel() * tensors[n].element_size() for n in names)],
                            dtype=torch.int64, device=self.device)
        head = mine.clone()
        self.pg.broadcast([head], opts).wait()
        # every member learns whether every receiver matched (MIN of a flag), so all skip the payload together
        # and stay in step; each raises, the sender included
        match = torch.tensor([int(torch.equal(head, mine))], dtype=torch.int32, device=self.device)
        ar = dist.AllreduceOptions()
        ar.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([match], ar).wait()
        if not int(match.item()):
            raise ValueError(f"weight broadcast: the sender sends (tensors, elements, bytes) {head.tolist()}, "
                             f"rank {self.rank} holds {mine.tolist()}" + ("" if self.rank == 0 or torch.equal(
                                 head, mine) else " (this rank differs)") + "; nothing was sent")
        total = 0
        for dtype in sorted(by_dtype, key=str):
            group = [tensors[n] for n in by_dtype[dtype]]
            flat = _flatten_dense_tensors(group) if self.rank == 0 else torch.empty(
                sum(t.numel() for t in group), dtype=dtype, device=group[0].device)
            self.pg.broadcast([flat], opts).wait()
            if self.rank != 0:
                for dst, src in zip(group, _unflatten_dense_tensors(flat, group)):
                    dst.copy_(src)
            total += flat.numel() * flat.element_size()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.num_broadcasts += 1
        return total

    def close(self) -> None:
        """Release this member's side of the group, without waiting for the others.

        NCCL: ``abort`` (ncclCommAbort, local). Not ``shutdown``: it flushes through ncclCommFinalize, which
        waits for every member to close too (pytorch/pytorch#141510: "a hang is expected" otherwise) - on two
        H200s the trainer closing at the end of its run hung there while the workers still held the group.
        Gloo: ``shutdown``."""
        if self.device.type == "cuda" and hasattr(self.pg, "abort"):
            self.pg.abort()
            return
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
