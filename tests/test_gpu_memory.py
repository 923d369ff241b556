"""``tests/gpu_memory.py`` (through ``tests/conftest.py``): the modules of the ``gpu-memory`` xdist
group run one at a time across workers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
import time

import pytest

pytestmark = pytest.mark.xdist_group("gpu-memory")


@pytest.fixture(scope="module")
def held():  # stands for a module fixture holding tens of GB of GPU memory
    start = time.time()
    yield
    with open({log!r}, "a") as log:
        log.write(f"{{start}} {{time.time()}}\\n")


@pytest.mark.parametrize("index", range(2))
def test_holds(held, index):
    time.sleep(0.3)
'''


def test_gpu_memory_modules_never_run_beside_each_other(tmp_path):
    """Two such modules of two tests each, over two workers: every span of a module's fixture on a
    worker (from setup to teardown) must be disjoint from every other."""
    log = tmp_path / "spans.txt"
    fixture = "from tests.gpu_memory import one_gpu_memory_module_at_a_time  # noqa: F401\n"
    (tmp_path / "conftest.py").write_text(fixture)
    for name in ("first", "second"):
        (tmp_path / f"test_{name}.py").write_text(MODULE.format(log=str(log)))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "-o", "addopts=", str(tmp_path)],
                          cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) >= 2, spans  # each module at least once
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, spans
