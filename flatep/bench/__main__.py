"""``python -m flatep.bench`` is ambiguous: point to the two benchmark commands."""
import sys

print(
    "flatep.bench is a package. Run `flatep bench` (or `python -m flatep bench`) for the sweep on one device, "
    "or `torchrun --nproc-per-node N -m flatep.bench.distributed` for the benchmark with one process per rank.",
    file=sys.stderr,
)
sys.exit(2)
