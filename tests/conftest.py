"""Without a GPU, Triton kernels run in the interpreter; it must be chosen before any kernel is
defined. The modules that take most of a GPU's memory run one at a time across xdist workers
(:mod:`tests.gpu_memory`)."""
import os

import torch

from tests.gpu_memory import one_gpu_memory_module_at_a_time  # noqa: F401  (an autouse fixture)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
