"""K-loop instruction counts of the mxfp4 grouped GEMM's tiles, from an sm_90 compile on any machine.

    python bench/scripts/mxfp4_kloop_sass.py                      # default_config's tiles
    python bench/scripts/mxfp4_kloop_sass.py --candidates         # and every quant-bench candidate
    python bench/scripts/mxfp4_kloop_sass.py --module old_quant_gemm.py   # another revision's kernel
    python bench/scripts/mxfp4_kloop_sass.py --json               # one JSON object a line

Needs no GPU: Triton compiles the kernel for an sm_90 target and its bundled ``cuobjdump`` disassembles
it (set ``TRITON_INTERPRET`` off; the GPU machine runs Triton 3.6, whose counts the docstrings quote:
``pip install --target DIR triton==3.6.0`` and put ``DIR`` first on ``PYTHONPATH``). For each tile:
the instructions of the innermost loop holding the MMA (the one-multiply K loop), per weight and
thread (``instructions * 32 * warps / (block_n * block_k)``), how many of them load one scale byte
from shared memory (``LDS.U8``), and the registers a thread (``REG`` of ``cuobjdump -res-usage``).
A tile with ``lane_words`` is followed by the same tile without, for comparison.
Instruction counts are not time: the decode is latency-bound as well, so a change they favour still
needs a GPU timing (``python -m flatep.bench.experts_phase --against``).
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

from flatep.kernels.quant_gemm import GemmConfig, default_config  # noqa: E402
from flatep.quant.bench import CANDIDATES  # noqa: E402

POINTER_TYPES = {"a_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*i32", "slot_w_ptr": "*i32", "s_ptr": "*u8",
                 "slot_s_ptr": "*u8", "offsets_ptr": "*i32", "redo_ptr": "*i32"}
ALIGNED = ("a_ptr", "w_ptr", "s_ptr", "slot_w_ptr", "slot_s_ptr", "out_ptr", "offsets_ptr", "N", "stride_am",
           "stride_om", "stride_se", "stride_sk")  # as the pools' tensors and the layer's shapes give them


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


def k_loop(module, config: GemmConfig, inner: int) -> dict:
    """Compile ``module``'s mxfp4 kernel with ``config`` for sm_90 and count its K loop."""
    kernel = module._mxfp4_grouped_kernel
    natural = not config.swap_ab and config.block_m >= 64
    constants = dict(K=inner, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     GROUP_M=config.group_m, GROUPS=128, SWAP_AB=config.swap_ab, NATURAL_K=natural,
                     LANE_WORDS=config.lane_words, ONE_MULTIPLY=True, INTERPRET=False, stride_sn=1)
    constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
    signature = {name: "constexpr" if name in constants else POINTER_TYPES.get(name, "i32")
                 for name in kernel.arg_names}
    attributes = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
                  for name in ALIGNED if name in signature}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attributes), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    tool = str(Path(get_ptxas(90).path).parent / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    instructions = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    # A backward branch closes a loop; the K loop is the innermost one holding an MMA.
    loops = []
    for address, text in instructions:
        target = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            body = [line for at, line in instructions if int(target.group(1), 16) <= at <= address]
            if any("MMA" in line for line in body):
                loops.append(body)
    body = min(loops, key=len)
    tile = config.label
    if config.lane_words and "LANE_WORDS" not in kernel.arg_names:  # an older kernel, which ignores the option
        tile += " (not in this kernel)"
    return {"tile": tile, "instructions": len(body),
            "per_weight": round(len(body) * 32 * config.num_warps / (config.block_n * config.block_k), 2),
            "scale_byte_loads": sum("LDS.U8" in line for line in body),
            "registers": int(re.search(r"REG:(\d+)", usage).group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", type=Path, help="a quant_gemm.py to compile instead of this tree's")
    parser.add_argument("--candidates", action="store_true", help="also every mxfp4 candidate of flatep.quant.bench")
    parser.add_argument("--inner", type=int, default=3584, help="K, the input columns (default Kimi-K3's hidden size)")
    parser.add_argument("--json", action="store_true", help="print one JSON object a tile")
    args = parser.parse_args()
    module = load_module(args.module)
    configs = [default_config(rows, 1, "mxfp4") for rows in (16, 32, 64)]
    if args.candidates:
        configs += [config for config in CANDIDATES["mxfp4"] if config not in configs]
    with_twins = [variant for config in configs for variant in
                  ([config, dataclasses.replace(config, lane_words=False)] if config.lane_words else [config])]
    configs = list(dict.fromkeys(with_twins))  # a twin may be a candidate too
    if not args.json:
        print(f"Triton {triton.__version__}, sm_90, K = {args.inner}, {args.module or 'this tree'}")
    for config in configs:
        row = k_loop(module, config, args.inner)
        if args.json:
            print(json.dumps({**row, "lane_words": config.lane_words, "triton": triton.__version__}))
        else:
            print(f"{row['tile']:40s} {row['instructions']:4d} instructions ({row['per_weight']:.2f} a weight and "
                  f"thread), {row['scale_byte_loads']:2d} LDS.U8, {row['registers']} registers")


if __name__ == "__main__":
    main()
