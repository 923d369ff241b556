"""An autouse fixture (imported by ``tests/conftest.py``): the modules of the ``gpu-memory`` xdist
group run one at a time across pytest-xdist workers; and the file lock it takes
(:func:`worker_lock`), which a fixture computed once for all workers shares too. No torch import,
so that a small pytest run can load it quickly (``tests/test_gpu_memory.py``)."""
from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path

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
    with worker_lock(run_directory(request, tmp_path_factory) / f"{GPU_MEMORY_GROUP}.lock"):
        yield


@contextlib.contextmanager
def worker_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Holds an exclusive lock on the file ``path`` (made if absent) within the block: one
    pytest-xdist worker at a time (pass a path under ``tmp_path_factory.getbasetemp().parent``,
    which the workers of one run share). Waiting longer than ``timeout_s`` raises ``TimeoutError``."""
    with open(path, "w") as lock:
        waited = time.monotonic()
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited > timeout_s:
                    raise TimeoutError(f"another xdist worker held the lock {path} for over {timeout_s:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_directory(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this pytest run that all its xdist workers share (each worker's base
    temporary directory sits in it), or the run's own base directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(request.config, "workerinput") else base
