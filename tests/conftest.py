"""Without a GPU, Triton kernels run in the interpreter; it must be chosen before any kernel is defined."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
