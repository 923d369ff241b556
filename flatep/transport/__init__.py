"""Transports: how the ranks of an EP group reach each other."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from flatep.transport.base import Group
from flatep.transport.collective import CollectiveGroup
from flatep.transport.local import LocalGroup
from flatep.transport.nvlink import NVLinkGroup

TRANSPORTS = ("auto", "local", "nvlink", "collective")


def init_group(
    process_group: dist.ProcessGroup | str | None = None,
    transport: str = "auto",
    ranks: int | None = None,
    device: torch.device | str | None = None,
    barrier_timeout: float = 60.0,
    eager_check: bool = True,
    static_splits: bool = False,
) -> Group:
    """Make an EP group.

    Every process of a per-process group must call this with the same arguments (it is collective).

    Args:
        process_group: the EP ranks, one per process (default: the whole world, once
            ``torch.distributed`` is initialised). A transport name is accepted here too, so
            ``init_group("local", ranks=8)`` keeps working.
        transport: ``local`` (``ranks`` virtual ranks stacked on dim 0 of one tensor, one process),
            ``nvlink`` (one process per GPU, symmetric memory over P2P, no multicast),
            ``collective`` (``torch.distributed`` all-to-all: NCCL across nodes, gloo on CPU), or
            ``auto``: ``local`` when ``ranks`` is given; otherwise ``nvlink`` when every rank
            computes on a CUDA GPU of one host and every pair of those GPUs has peer access (ranks
            sharing a GPU need ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), else ``collective``.
            Every rank reaches the same choice: it is made from facts gathered from all ranks.
        ranks: ``R`` for the local transport; per-process transports take it from the group.
        device: local: where the buffers live (default CUDA if available, else CPU). nvlink: this
            process's GPU (default: the current device). collective: see :class:`CollectiveGroup`.
        barrier_timeout: seconds an nvlink barrier waits for the other ranks before it gives up
            (:meth:`Group.check` then raises :class:`TimeoutError`).
        eager_check: ``True`` (default): every eager step checks itself before returning, so bad
            input and dead ranks raise from the step that met them (costs host
            synchronisations). ``False``: steps never read back to the host (what CUDA graphs and
            latency-bound serving want); call :meth:`Group.check` after graph replays or every few
            steps to raise what the device recorded. See :attr:`Group.eager_check`.
        static_splits: collective transport only (with ``transport="auto"``, where it is the one
            chosen): dispatch and combine send fixed-size messages and read nothing back to the host,
            for more bytes on the link (see :class:`flatep.transport.collective.CollectiveGroup`).
            The other transports never read their exchanges' sizes on the host.

    Raises:
        ValueError: for arguments of the wrong type or value, naming the argument.
    """
    if process_group is not None and not isinstance(process_group, (str, dist.ProcessGroup)):
        raise ValueError(
            f"process_group must be a torch.distributed ProcessGroup, a transport name or None, got {process_group!r}"
        )
    if not isinstance(transport, str):
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if isinstance(process_group, str):
        if transport != "auto":
            raise ValueError(f"transport given twice: {process_group!r} and transport={transport!r}")
        process_group, transport = None, process_group
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if not isinstance(static_splits, bool):
        raise ValueError(f"static_splits must be True or False, got {static_splits!r}")
    if static_splits and (transport in ("local", "nvlink") or ranks is not None):
        raise ValueError(f"static_splits is for the collective transport, got transport={transport!r}, ranks={ranks!r}")
    if transport == "local" or (transport == "auto" and ranks is not None):
        if process_group is not None:
            raise ValueError("process_group is for the per-process transports, not for local virtual ranks")
        if ranks is None:
            raise ValueError("ranks is required for the local transport")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return LocalGroup(ranks, device, eager_check)
    if ranks is not None:
        raise ValueError(f"ranks is only for the local transport; the {transport} transport takes R from the process group")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "no process group: initialise torch.distributed first (e.g. run under torchrun), "
            "or pass ranks=R for virtual ranks in this process"
        )
    if transport == "auto":
        transport = "nvlink" if nvlink_reachable(process_group, device) else "collective"
    if transport == "nvlink":
        return NVLinkGroup(process_group, device, barrier_timeout, eager_check)
    return CollectiveGroup(process_group, device, eager_check, static_splits)


def nvlink_reachable(process_group: dist.ProcessGroup | None = None, device: torch.device | str | None = None) -> bool:
    """Whether every rank of the group can map every other rank's GPU memory (collective).

    True when every rank's device is a CUDA GPU, all on one host, and each pair either has peer
    access or is the same GPU with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` on both ranks.
    """
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    facts: dict[str, object] = {"host": socket.gethostname(), "gpu": on_gpu}
    if on_gpu:
        index = torch.cuda.current_device() if device is None or torch.device(device).index is None else torch.device(device).index
        uuids = [str(torch.cuda.get_device_properties(other).uuid) for other in range(torch.cuda.device_count())]
        facts.update(
            uuid=uuids[index],
            reach={uuid: other != index and torch.cuda.can_device_access_peer(index, other) for other, uuid in enumerate(uuids)},
            overlap=os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1",
        )
    everyone: list[dict] = [{} for _ in range(dist.get_world_size(process_group))]
    dist.all_gather_object(everyone, facts, group=process_group)
    if not all(rank["gpu"] for rank in everyone) or len({rank["host"] for rank in everyone}) > 1:
        return False
    for first in everyone:
        for second in everyone:
            if first is second:
                continue
            if first["uuid"] == second["uuid"]:
                if not (first["overlap"] and second["overlap"]):
                    return False
            elif not first["reach"].get(second["uuid"], False):
                return False
    return True


__all__ = ["CollectiveGroup", "Group", "LocalGroup", "NVLinkGroup", "TRANSPORTS", "init_group", "nvlink_reachable"]
