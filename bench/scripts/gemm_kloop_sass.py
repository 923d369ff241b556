"""The grouped GEMMs' K loops (mxfp4, fp8, bf16 decode), and whether their programs fit an SM: sm_90 compiles.

    python bench/scripts/gemm_kloop_sass.py                       # the default tiles (mxfp4, fp8, bf16 decode)
    python bench/scripts/gemm_kloop_sass.py --candidates          # and every quant-bench candidate
    python bench/scripts/gemm_kloop_sass.py --format mxfp4 --module old_quant_gemm.py   # another revision
    python bench/scripts/gemm_kloop_sass.py --json                # one JSON object a tile

Needs no GPU: Triton compiles the kernels for an sm_90 target and its bundled ``cuobjdump``
disassembles them (the GPU machine runs Triton 3.6, whose counts the docstrings quote: ``pip install
--target DIR triton==3.6.0`` and put ``DIR`` first on ``PYTHONPATH``). For each tile: the
instructions of the innermost loop holding the MMA (the K loop; mxfp4's one-multiply pass), per
weight and thread (``instructions * 32 * warps / (block_n * block_k)``), how many of them load one
scale byte from shared memory (``LDS.U8``, mxfp4), the registers a thread (``REG`` of ``cuobjdump
-res-usage``), the shared memory, and how many programs fit an SM at once against the
``programs_per_sm`` the persistent grid launches: the programs that do not fit start only when
resident ones have finished their whole tile loops, a second wave with fewer programs beside each
other (where the tiles are latency-bound, up to those programs' whole loops more). An mxfp4 tile with
``lane_words`` is followed by the same tile without, for comparison (``"listed": false`` in the
JSON where that twin is neither a default tile nor a candidate). Instruction counts are not
time: a change they favour still needs a GPU timing (``python -m flatep.bench.experts_phase
--against``).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter has no compiler
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's flatep, installed or not

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flatep.bench.sass import innermost_mma_loop  # noqa: E402
from flatep.kernels import decode_gemm  # noqa: E402
from flatep.kernels.packed_tiles import GemmConfig, default_config  # noqa: E402
from flatep.quant.bench import CANDIDATES  # noqa: E402

POINTER_TYPES = {  # per format: the kernels' pointer arguments (the others are int32 or constexpr)
    "mxfp4": {"a_src": "*bf16", "out_ptr": "*bf16", "w_src": "*i32", "slot_w_src": "*i32", "s_src": "*u8",
              "slot_s_src": "*u8", "offsets_ptr": "*i32", "redo_ptr": "*i32"},
    "fp8": {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
            "slot_w_ptr": "*fp8e4nv", "slot_w_scale_ptr": "*fp32", "out_ptr": "*bf16", "offsets_ptr": "*i32"},
    "bf16": {"a_ptr": "*bf16", "w_ptr": "*bf16", "slot_ptr": "*bf16", "weight_ptr": "*fp32", "out_ptr": "*bf16",
             "offsets_ptr": "*i32"},
}
INNER = {"mxfp4": 3584, "fp8": 7168, "bf16": 7168}  # K of the gate/up GEMMs: Kimi-K3's, Kimi-K2's hidden sizes
FORMATS = ("mxfp4", "fp8", "bf16")
SM_REGISTERS, SM_SHARED_BYTES, SM_WARPS, SM_PROGRAMS = 65536, 233472, 64, 32  # sm_90 (H100, H200)
RESERVED_SHARED_BYTES = 1024  # per program, by the driver
ALIGNED = ("a_ptr", "a_src", "w_src", "s_src", "slot_w_src", "slot_s_src", "a_scale_ptr", "w_scale_ptr", "slot_w_scale_ptr",
           "slot_ptr", "out_ptr", "offsets_ptr", "N", "stride_am", "stride_om", "stride_se", "stride_sk", "stride_wg",
           "stride_sg", "stride_wn")  # as the layer gives them


def load_module(path: Path | None):
    """This tree's ``flatep.kernels.quant_gemm``, or the module in the file ``path``."""
    if path is None:
        from flatep.kernels import quant_gemm
        return quant_gemm
    spec = importlib.util.spec_from_file_location("quant_gemm_compared", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def resident(registers: int, shared_bytes: int, warps: int) -> int:
    """Programs of ``warps`` warps, ``registers`` a thread and ``shared_bytes`` each that an sm_90 SM
    holds at once (registers are allocated per warp in units of 256)."""
    warp_registers = -(-registers * 32 // 256) * 256
    return min(SM_REGISTERS // (warp_registers * warps), SM_SHARED_BYTES // (shared_bytes + RESERVED_SHARED_BYTES),
               SM_WARPS // warps, SM_PROGRAMS)


def k_loop(module, format: str, config: GemmConfig, inner: int) -> dict:
    """Compile ``format``'s kernel (mxfp4 and fp8: ``module``'s; bf16: the decode kernels' gate/up
    form) with ``config`` for sm_90 and count its K loop."""
    kernel = {"mxfp4": module._mxfp4_grouped_kernel, "fp8": module._fp8_grouped_kernel,
              "bf16": decode_gemm._decode_kernel}[format]
    constants = dict(K=inner, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     GROUP_M=config.group_m, GROUPS=128, SWAP_AB=config.swap_ab, RESCALE=config.rescale, GATED=True,
                     NATURAL_K=not config.swap_ab and config.block_m >= 64, LANE_WORDS=config.lane_words,
                     ONE_MULTIPLY=True, INTERPRET=False, stride_sn=1, TMA=not config.swap_ab, MMA=False)
    constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
    types = dict(POINTER_TYPES[format])
    if constants.get("TMA"):  # mxfp4's unswapped tiles copy by tensor descriptor (the layer's scales fit)
        words, blocks = config.block_k // 8, config.block_k // 32
        types.update(a_src=f"tensordesc<bf16[{config.block_m},{config.block_k}]>",
                     **dict.fromkeys(("w_src", "slot_w_src"), f"tensordesc<i32[1,{config.block_n},{words}]>"),
                     **dict.fromkeys(("s_src", "slot_s_src"), f"tensordesc<u8[1,{blocks},{config.block_n}]>"))
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    attributes = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
                  for name in ALIGNED if name in signature}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attributes), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages,
                                       "maxnreg": config.max_registers})
    tool = str(Path(get_ptxas(90).path).parent / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    body = innermost_mma_loop(sass)
    tile = config.label
    if config.lane_words and "LANE_WORDS" not in kernel.arg_names:  # an older kernel, which ignores the option
        tile += " (not in this kernel)"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    weights = config.block_n * config.block_k * (2 if format == "bf16" else 1)  # gated: a gate and an up tile
    return {"tile": tile, "instructions": len(body), "per_weight": round(len(body) * 32 * config.num_warps / weights, 2),
            "scale_byte_loads": sum("LDS.U8" in line for line in body), "registers": registers, "stack_bytes": stack,
            "shared_bytes": compiled.metadata.shared, "programs_per_sm": config.programs_per_sm,
            "resident_per_sm": resident(registers, compiled.metadata.shared, config.num_warps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=FORMATS, nargs="*", default=list(FORMATS),
                        help="the kernels to compile (default all three)")
    parser.add_argument("--module", type=Path, help="a quant_gemm.py to compile instead of this tree's (mxfp4, fp8)")
    parser.add_argument("--candidates", action="store_true", help="also every candidate of flatep.quant.bench "
                                                                  "(mxfp4, fp8)")
    parser.add_argument("--inner", type=int, help="K, the input columns (default: Kimi-K3's hidden size for mxfp4, "
                                                   "Kimi-K2's for fp8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object a tile")
    args = parser.parse_args()
    module = load_module(args.module)
    if not args.json:
        print(f"Triton {triton.__version__}, sm_90, {args.module or 'this tree'}")
    for format in args.format:
        if format == "bf16":
            configs = [*(decode_gemm.decode_config(rows, 1) for rows in (16, 32, 64)), decode_gemm.HOT_TILES]
        else:
            configs = [default_config(rows, 1, format) for rows in (16, 32, 64)]
        if args.candidates and format != "bf16":
            configs += CANDIDATES[format]
        with_twins = [variant for config in configs for variant in
                      ([config, dataclasses.replace(config, lane_words=False)] if config.lane_words else [config])]
        for config in dict.fromkeys(with_twins):  # in order, each once (a twin may be a candidate too)
            row = k_loop(module, format, config, args.inner or INNER[format])
            if args.json:
                print(json.dumps({"format": format, **row, "lane_words": config.lane_words,
                                  "listed": config in configs, "triton": triton.__version__}))
                continue
            scale_loads = f", {row['scale_byte_loads']:2d} LDS.U8" if format == "mxfp4" else ""
            print(f"{format:5s} {row['tile']:40s} {row['instructions']:4d} instructions ({row['per_weight']:.2f} a "
                  f"weight and thread){scale_loads}, {row['registers']} registers ({row['stack_bytes']} bytes of "
                  f"stack), {row['shared_bytes'] // 1024} KiB shared, {row['resident_per_sm']} resident a SM for "
                  f"{row['programs_per_sm']} launched")


if __name__ == "__main__":
    main()
