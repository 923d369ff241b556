"""Switches read from the environment once, at import."""
from __future__ import annotations

import os


def environment_flag(name: str, default: bool) -> bool:
    """The environment variable ``name`` as a flag: ``0`` off, ``1`` on, unset ``default``.

    Raises:
        ValueError: for any other value (``yes``, ``false``, ...), which would otherwise pass for one
            of the two without saying which.
    """
    value = os.environ.get(name)
    if value not in (None, "0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (or unset: {int(default)}), got {value!r}")
    return default if value is None else value == "1"
