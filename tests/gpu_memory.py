"""An autouse fixture (imported by ``tests/conftest.py``): the modules of the ``gpu-memory`` xdist
group run one at a time across pytest-xdist workers. No torch import, so that a small pytest run
can load it quickly (``tests/test_gpu_memory.py``)."""
from __future__ import annotations

import fcntl
import time

import pytest

GPU_MEMORY_GROUP = "gpu-memory"
LOCK_TIMEOUT_S = 3600.0


@pytest.fixture(scope="module", autouse=True)
def one_gpu_memory_module_at_a_time(request, tmp_path_factory):
    """The modules marked ``xdist_group("gpu-memory")`` each take tens of GB of GPU memory, in module
    fixtures too: across pytest-xdist workers, one such module runs at a time, under a file lock
    held from before the module's fixtures are set up until after they are torn down. The group
    mark alone does not do it: pytest-xdist's ``loadgroup`` sends a group to one worker by a suffix
    of the test ids, which pytest 9 no longer takes (pytest 9.2, pytest-xdist 3.8: the tests of a
    group went to both workers). A lock held longer than ``LOCK_TIMEOUT_S`` makes the waiter raise."""
    marker = request.node.get_closest_marker("xdist_group")
    group = None if marker is None else (marker.args[0] if marker.args else marker.kwargs.get("name"))
    if group != GPU_MEMORY_GROUP or not hasattr(request.config, "workerinput"):
        yield
        return
    path = tmp_path_factory.getbasetemp().parent / f"{GPU_MEMORY_GROUP}.lock"  # one directory per run, shared
    with open(path, "w") as lock:
        waited = time.monotonic()
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited > LOCK_TIMEOUT_S:
                    raise TimeoutError(f"another xdist worker held the {GPU_MEMORY_GROUP} lock ({path}) for over "
                                       f"{LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
