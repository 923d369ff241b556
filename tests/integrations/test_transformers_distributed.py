"""Two gloo processes, one EP rank each: tiny transformers models sharded over the collective transport
generate the unsharded model's greedy tokens on every rank (fp32, CPU)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from flatep.integrations.tiny_models import TINY_FAMILIES  # noqa: E402
from tests.helpers import launch_workers  # noqa: E402

# The two workers take about 60 s on two cores alone (16 new tokens); with the other xdist worker busy
# beside them they took up to 2.4 times that. A hang still ends here, with the workers' output.
WORKER_TIMEOUT = 480
WORLD = 2


def test_two_gloo_processes_generate_the_unsharded_tokens(tmp_path):
    output = launch_workers("tests.integrations.worker", WORLD, ["--init-method", f"file://{tmp_path}/store"], WORKER_TIMEOUT)
    results = re.findall(r"RESULT rank=(\d) family=(\S+) policy=(\S+) tokens_equal=True .* maxvio=(\[.*\])", output)
    # every family under exact, the first under none, and under exact with fixed_capacity
    assert len(results) == WORLD * (len(TINY_FAMILIES) + 2), output
    for family in TINY_FAMILIES:  # the group-wide histogram is the same on every rank
        assert len({maxvio for _, name, policy, maxvio in results if (name, policy) == (family, "exact")}) == 1, output
