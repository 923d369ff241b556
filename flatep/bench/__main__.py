"""``torchrun --nproc-per-node N -m flatep.bench ...``: the benchmark with one process per rank."""
import sys

from flatep.bench.distributed import main

sys.exit(main())
