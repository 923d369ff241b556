"""Transports: how the ranks of an EP group reach each other."""
from __future__ import annotations

import torch

from flatep.transport.base import Group
from flatep.transport.local import LocalGroup

TRANSPORTS = ("local",)


def init_group(transport: str = "local", ranks: int | None = None, device: torch.device | str | None = None) -> Group:
    """Make an EP group.

    Args:
        transport: ``local`` (virtual ranks stacked on dim 0 of one tensor, one process).
        ranks: ``R`` for the local transport.
        device: where the local transport's buffers live (default: CUDA if available, else CPU).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if ranks is None:
        raise ValueError("ranks is required for the local transport")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return LocalGroup(ranks, device)


__all__ = ["Group", "LocalGroup", "init_group"]
