"""The Gluon fp8 kernel compiled for sm_90 without a GPU (its GPU tests are in tests/quant/test_quant_gpu.py):
it builds with the installed Triton, and ptxas keeps its MMAs overlapped with the scaling."""
from __future__ import annotations

import pytest
import torch
import triton

from flatep.kernels import fp8_wgmma
from tests.helpers import sm90_build, write_compiled

pytestmark = pytest.mark.skipif(fp8_wgmma.gluon is None, reason="this Triton has no Gluon Hopper API")


def _compile_for_sm90(inner: int, stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    rows = torch.empty(256, inner, dtype=torch.float8_e4m3fn)
    weights = torch.empty(2, 256, inner, dtype=torch.float8_e4m3fn)
    row_descriptor = fp8_wgmma.TensorDescriptor(rows, list(rows.shape), list(rows.stride()),
                                                [fp8_wgmma.BLOCK_M, fp8_wgmma.FP8_BLOCK], fp8_wgmma._shared_layout())
    weight_type = mangle_type(fp8_wgmma._weight_descriptor(weights))
    out_type = mangle_type(fp8_wgmma._out_descriptor(torch.empty(256, 256, dtype=torch.bfloat16)))
    kernel = fp8_wgmma._fp8_wgmma_kernel
    types = {"a_desc": mangle_type(row_descriptor), "w_desc": weight_type, "slot_w_desc": weight_type, "out_desc": out_type,
             "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "slot_w_scale_ptr": "*fp32", "out_ptr": "*bf16",
             "offsets_ptr": "*i32"}
    constants = {"K": inner, "BLOCK_M": fp8_wgmma.BLOCK_M, "BLOCK_N": fp8_wgmma.BLOCK_N, "BLOCK_K": fp8_wgmma.FP8_BLOCK,
                 "GROUP_M": 8, "GROUPS": 64, "NUM_STAGES": stages, "CHUNK": fp8_wgmma.CHUNK,
                 "CONSUMER_REGISTERS": fp8_wgmma.CONSUMER_REGISTERS, "PRODUCER_REGISTERS": fp8_wgmma.PRODUCER_REGISTERS,
                 "num_warps": fp8_wgmma.NUM_WARPS // 2}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": fp8_wgmma.NUM_WARPS // 2, "maxnreg": fp8_wgmma.MAX_REGISTERS})


def _write_compiled(inner: int, stages: int, directory: str) -> None:
    write_compiled(_compile_for_sm90(inner, stages), directory)


@pytest.mark.parametrize("inner, stages", [(7168, 5), (2048, 6)])
def test_compiles_for_sm90_with_overlapped_mmas(inner, stages, tmp_path):
    """Kimi-K2's gate/up and down K, at the 5 and 6 stages ``GemmConfig`` accepts: the kernel's
    shared memory (stages and the output tiles TMA stores from) fits Hopper's 227 KiB a block; the
    PTX waits for all but the last issued MMA before it scales a product, and (where Triton's
    bundled cuobjdump can read the cubin) the SASS keeps that wait: ptxas did not serialize the
    MMAs, which it does where a product's registers cross a loop's back edge in flight or registers
    run short (the module docstring); no registers spill, also at the consumers' and the producer's
    register counts after ``setmaxnreg``.

    The compile runs in a process of its own (:func:`tests.helpers.sm90_build`)."""
    shared, ptx, sass, usage = sm90_build(f"from tests.kernels.test_fp8_wgmma import _write_compiled; "
                                          f"_write_compiled({inner}, {stages}, {str(tmp_path)!r})", tmp_path)
    assert shared <= 227 * 1024
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    # Each of the two consumer warp groups' code waits with one MMA still running CHUNK - 1 times a chunk.
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") >= 2 * (fp8_wgmma.CHUNK - 1)
    assert "STACK:0" in usage  # no spills


def test_available_needs_a_hopper_gpu_and_triton_3_6(monkeypatch):
    """The kernel runs on sm_90 CUDA devices only, and only with a Triton whose Gluon takes
    warp_specialize as it calls it; elsewhere the Triton tiles run (default_config's fallback)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_wgmma, "_TRITON_VERSION", fp8_wgmma.MIN_TRITON)
    assert fp8_wgmma.available(torch.device("cuda"))
    assert not fp8_wgmma.available(torch.device("cpu"))
    monkeypatch.setattr(fp8_wgmma, "_TRITON_VERSION", (3, 5))
    assert not fp8_wgmma.available(torch.device("cuda"))
    monkeypatch.setattr(fp8_wgmma, "_TRITON_VERSION", fp8_wgmma.MIN_TRITON)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not fp8_wgmma.available(torch.device("cuda"))
