"""Reading a kernel's SASS (``cuobjdump -sass`` text) for the K-loop counts the benchmarks and tests
report."""
from __future__ import annotations

import re


def innermost_mma_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop holding a tensor-core MMA (``HMMA``, ``HGMMA``, ``QGMMA``
    ...): a kernel's K loop. A loop is closed by a backward branch (``BRA`` to a lower address).

    Raises:
        ValueError: no loop holds an MMA.
    """
    instructions = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for address, text in instructions:
        target = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            body = [line for at, line in instructions if int(target.group(1), 16) <= at <= address]
            if any("MMA" in line for line in body):
                loops.append(body)
    if not loops:
        raise ValueError("no loop of this SASS holds an MMA")
    return min(loops, key=len)
