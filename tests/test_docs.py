"""Every Python snippet of README.md and docs/*.md runs as written.

A snippet runs in this process, unless its first line says otherwise:
- ``run with: torchrun --nproc-per-node N FILE``: it runs as N processes (a local torchrun);
- ``needs a GPU`` / ``needs ... a model checkpoint``: it is skipped where that is missing, and the
  next snippet of the same file must be its CPU variant (first line ``# CPU variant...`` or
  ``# ... CPU variant; ...``), which runs.
- ``needs the NAME package``: an optional dependency (an extra of pyproject.toml that the CI does
  not install); it is skipped where ``NAME`` cannot be imported, and runs on a CPU otherwise.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import died_only_at_exit

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [
    (path, index, code)
    for path in FILES
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
]
TORCHRUN = re.compile(r"torchrun --nproc-per-node (\d+)")
PACKAGE = re.compile(r"needs the (\w+) package")


def _first_line(code: str) -> str:
    return code.splitlines()[0] if code.strip() else ""


def _needs(code: str) -> list[str]:
    """What a snippet's first line says it needs beyond a CPU: ``a GPU``, ``a model checkpoint``."""
    line = _first_line(code)
    if not line.startswith("#") or "needs " not in line:
        return []
    said = line.split("needs ", 1)[1].split("(")[0]
    return [what for what, word in (("a GPU", "GPU"), ("a model checkpoint", "checkpoint")) if word in said]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun(code: str, processes: int, tmp_path: Path) -> None:
    for attempt in range(2):  # one rerun for gloo's abort at exit only: see tests.helpers.EXIT_ABORT
        codes, logs = _torchrun_once(code, processes, tmp_path)
        if attempt == 1 or not died_only_at_exit(codes, logs):
            break
    assert all(c == 0 for c in codes), "\n".join(logs)


def _torchrun_once(code: str, processes: int, tmp_path: Path) -> tuple[list[int], list[str]]:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(processes)
    ]
    try:
        logs = [worker.communicate(timeout=300)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    return [worker.returncode for worker in workers], logs


@pytest.mark.parametrize("path, index, code", SNIPPETS, ids=[f"{p.relative_to(ROOT)}-{i}" for p, i, _ in SNIPPETS])
def test_snippet_runs(path, index, code, tmp_path, monkeypatch):
    needs = _needs(code)
    if "a model checkpoint" in needs:
        pytest.skip("needs a model checkpoint; its CPU variant follows it")
    package = PACKAGE.search(_first_line(code))
    if package:
        pytest.importorskip(package.group(1))
    launch = TORCHRUN.search(_first_line(code))
    if "a GPU" in needs and torch.cuda.device_count() < (int(launch.group(1)) if launch else 1):
        pytest.skip("needs a GPU per process; its CPU variant follows it")
    if launch:
        _torchrun(code, int(launch.group(1)), tmp_path)
    else:
        monkeypatch.chdir(tmp_path)
        exec(compile(code, f"{path.name} snippet {index}", "exec"), {"__name__": "__main__"})


def test_every_snippet_that_needs_more_than_a_cpu_has_a_cpu_variant_next():
    assert SNIPPETS, "no snippets found"
    for position, (path, index, code) in enumerate(SNIPPETS):
        if not _needs(code):
            continue
        following = SNIPPETS[position + 1] if position + 1 < len(SNIPPETS) else None
        assert following is not None and following[0] == path, f"{path.name} snippet {index}: no CPU variant after it"
        assert "CPU variant" in _first_line(following[2]) and not _needs(following[2]), (
            f"{path.name} snippet {index} needs {_needs(code)}; the next snippet must be its CPU variant"
        )


def test_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[2:6] == ["```bash", 'pip install -e ".[test]" && flatep bench', "python -m pytest tests", "```"]


def test_only_the_exit_abort_of_gloo_earns_a_rerun():
    from tests.helpers import EXIT_ABORT

    assert died_only_at_exit([0, -6], ["ok", f"done\n{EXIT_ABORT}\n"])
    assert not died_only_at_exit([0, 0], ["", ""])  # nothing failed
    assert not died_only_at_exit([1, -6], ["Traceback ...", EXIT_ABORT])  # a real failure beside it
    assert not died_only_at_exit([-6], ["Assertion failed: something else"])
