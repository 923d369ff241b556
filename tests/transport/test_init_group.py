"""init_group: which transport it picks, and clear errors for arguments that cannot work (no processes needed)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from flatep import init_group
from flatep.transport import LocalGroup

pytestmark = pytest.mark.skipif(dist.is_initialized(), reason="checks behaviour without a process group")


def test_local_transport_by_name_keyword_or_ranks():
    for group in (init_group("local", ranks=3, device="cpu"), init_group(transport="local", ranks=3, device="cpu"),
                  init_group(ranks=3, device="cpu")):
        assert isinstance(group, LocalGroup) and group.world == 3 and group.stacked


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(transport="carrier-pigeon"), "transport must be one of"),
        (dict(transport="local"), "ranks is required"),
        (dict(process_group="local", transport="nvlink", ranks=2), "transport given twice"),
        (dict(transport="collective", ranks=2), "ranks is only for the local transport"),
        (dict(transport="nvlink"), "no process group"),
        (dict(), "no process group"),
    ],
)
def test_bad_arguments_raise_clearly(arguments, message):
    with pytest.raises(ValueError, match=message):
        init_group(**arguments)
