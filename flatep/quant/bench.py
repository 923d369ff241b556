"""GPU benchmark of the packed expert formats: grouped expert GEMMs and weight pushes.

``python -m flatep.quant.bench --out quant.json`` measures, on one GPU, with CUDA-graph timing
(median of replays, the arms' replays interleaved, their spread reported):

- Kimi-K2 experts of one rank (``H=7168``, ``I=2048``, 48 experts) in fp8 against bf16, and
  Kimi-K3 experts of one rank (``H=3584``, ``I=3072``, 112 experts at EP8) in mxfp4 against bf16,
  at 16, 128 and 1024 rows per expert: the gate/up GEMM and the down GEMM separately (bf16:
  ``torch._grouped_mm``; packed: the Triton kernels over a few tile configs, fp8 including its
  activation quantization; fp8 also ``torch._scaled_grouped_mm`` with row-wise scales as a
  reference point), and the whole experts step (:func:`flatep.experts.grouped_swiglu`).
  Each packed arm is first checked against the torch reference path (relative error recorded).
- the weight push of one borrowed expert per format (local transport, two virtual ranks on one
  GPU: a device-memory copy, not a link; it shows the byte ratio, not NVLink time).

``python -m flatep.quant.bench --quick --out quick.json`` only times the two GEMMs of the same
cells, bf16 against every candidate tile config of the format (:data:`CANDIDATES` and
:func:`default_config`), one round each, to pick the configs in a few minutes at most: every
config's relative error against the torch reference is recorded, and a config whose single eager
call takes over :data:`SKIP_FACTOR` times the best graph time so far is not timed further (the
slow mxfp4 configs at 1024 rows per expert would take most of the run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import torch

from flatep.bench.timing import copy_ceiling_gbps, device_name, time_interleaved, time_us
from flatep.config import EPConfig, preset
from flatep.experts.grouped import grouped_swiglu, quantized_grouped_mm
from flatep.experts.pool import ExpertPool
from flatep.kernels import fp8_wgmma
from flatep.kernels.mxfp4_dequant import mxfp4_grouped_mm_bf16
from flatep.kernels.packed_tiles import GemmConfig, default_config
from flatep.kernels.quant_gemm import fp8_grouped_mm_triton, mxfp4_grouped_mm_triton
from flatep.quant.tensor import QuantizedTensor, pool_layout
from flatep.transport import init_group

ROWS_PER_EXPERT = (16, 128, 1024)
REPLAYS = 10  # graph replays of each arm per round (CPU: eager calls)
STARTED = time.perf_counter()
# Tile configs timed per format (with default_config's): short row tiles with deep pipelines for
# decode shards (weight streaming), with and without swap_ab, tall 8-warp tiles for prefill; mxfp4's
# short tiles run unswapped on mma.sync, with more programs per SM (see default_config).
CANDIDATES = {
    "fp8": (
        GemmConfig(16, 128, 128, num_warps=4, num_stages=5),
        GemmConfig(32, 128, 128, num_warps=4, num_stages=5),
        GemmConfig(16, 128, 128, num_warps=4, num_stages=5, swap_ab=True),
        GemmConfig(32, 128, 128, num_warps=4, num_stages=5, swap_ab=True),
        GemmConfig(64, 128, 128, num_warps=4, num_stages=4),
        # One 8-warp 128-row program fits an SM (248 registers a thread, 128 KiB of shared memory at
        # four stages; bench/scripts/gemm_kloop_sass.py), so one is launched per SM: a second would
        # only wait for the first's whole tile loop.
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, programs_per_sm=1),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, group_m=16, programs_per_sm=1),
        # The accumulator rescaled per K step (``rescale``): one accumulator in registers, not two.
        # Local sm_90 compile (Triton 3.6), registers a thread: 64 x 128 on 4 warps 219 (254
        # unrescaled), 128 x 128 on 8 warps 179 (248), 256 x 128 on 8 warps 249 (255, the
        # limit, unrescaled). 128 x 128 and 256 x 128 load 1.5 and 2 times fewer
        # activation and weight bytes per product than 64 x 128 (more rows share each weight
        # tile), which matters where the loads into shared memory, not the MMA, bound a step at
        # prefill sizes; 64 x 128 rescaled tells the rescaling's own cost.
        GemmConfig(64, 128, 128, num_warps=4, num_stages=4, rescale=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=3, rescale=True, programs_per_sm=1),
        GemmConfig(256, 128, 128, num_warps=8, num_stages=3, rescale=True, programs_per_sm=1),
        # 128 x 128 rescaled on 4 warps (one warp group: 238 registers a thread, 99 KB of shared
        # memory at 3 stages): two programs fit an SM, and while one scales its accumulator the
        # other's MMA can run (the 8-warp tiles' two warp groups wait for each other every K step).
        GemmConfig(128, 128, 128, num_warps=4, num_stages=3, rescale=True, programs_per_sm=2),
        # The Gluon kernel (flatep.kernels.fp8_wgmma; Hopper only): each step's product scaled while
        # the next step's MMA runs; one warp-specialized program an SM (a TMA producer warp, two
        # consumer warp groups).
        *(GemmConfig(128, 128, 128, num_warps=8, num_stages=stages, programs_per_sm=1, wgmma=True)
          for stages in (5, 6)),
    ),
    "mxfp4": (
        GemmConfig(16, 128, 64, num_warps=4, num_stages=4, programs_per_sm=4),
        # Wider, deeper or two-warp 16-row tiles share the activations' permutation and a step's
        # fixed cost over more weights a warp (local sm_90 compile, instructions per weight in the
        # K loop, Triton 3.6: 3.80 for 16 x 128 x 64 on 4 warps; 3.23 for 16 x 256 x 64, 3.44 for
        # 16 x 128 x 128, 3.30 for 16 x 128 x 64 on 2 warps; 168, 168 and 188 registers a thread).
        GemmConfig(16, 256, 64, num_warps=4, num_stages=4, programs_per_sm=3),
        # The lane word order (``lane_words``; default_config's 16-row tile takes it) where it cuts
        # a lane's scale loads, K-loop instructions in a local sm_90 compile (Triton 3.6): 385
        # against 413 for 16 x 256 x 64 on 4 warps, 471 against 493 for 32 x 128 x 64 on 2, 374
        # against 386 for the swapped 16 x 128 x 128 (392 against 423 for the default 16-row tile,
        # 443 against 472 for the 32-row one). With 128-wide unswapped K steps it adds register
        # moves instead (476 against 425 for 16 x 128 x 128 on 4 warps, before the second-pass
        # flag followed the scale bytes); on 2 warps, default_config's tile, it cuts them (654
        # against 754, and 8 scale byte loads against 32).
        GemmConfig(16, 256, 64, num_warps=4, num_stages=4, programs_per_sm=3, lane_words=True),
        GemmConfig(32, 128, 64, num_warps=2, num_stages=3, programs_per_sm=3, lane_words=True),
        GemmConfig(32, 256, 64, num_warps=4, num_stages=3, lane_words=True),
        GemmConfig(16, 128, 128, num_warps=4, num_stages=3, swap_ab=True, lane_words=True),
        # The fewest instructions per weight of the 16-row tiles (2.79 a thread in its K loop against
        # 3.06 for the default), in 183 registers a thread: five programs fit an SM, not six.
        GemmConfig(16, 256, 64, num_warps=2, num_stages=3, programs_per_sm=5, lane_words=True),
        GemmConfig(16, 128, 128, num_warps=4, num_stages=3, programs_per_sm=3),
        # The default 16-row tile in column order: 188 registers a thread, five fit an SM.
        GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=5),
        # The 16-row default before 128-wide K steps (bench/scripts/mxfp4_tile_sweep.py).
        GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True),
        GemmConfig(16, 64, 128, num_warps=2, num_stages=3, programs_per_sm=6),
        GemmConfig(16, 128, 128, num_warps=4, num_stages=3, swap_ab=True),
        GemmConfig(32, 256, 64, num_warps=4, num_stages=3),
        # 128-wide K steps load each column's four scale bytes of a step as one cp.async, which
        # Triton pipelines; at 64 it loads two bytes a column synchronously each step and converts
        # their layout through shared memory behind a barrier (local sm_90 compile).
        GemmConfig(32, 128, 128, num_warps=4, num_stages=3),
        GemmConfig(32, 128, 64, num_warps=2, num_stages=3, programs_per_sm=3),
        # 166 registers a thread in a local sm_90 compile (the 32 x 256 tile takes 234): three fit an SM.
        GemmConfig(32, 128, 64, num_warps=4, num_stages=3, programs_per_sm=3),
        GemmConfig(64, 128, 64, num_warps=4, num_stages=3),
        # A 64 x 128 tile's K step of 64 takes 2 scale bytes a thread, too few for Triton to
        # pipeline their load (each step waits for it); 128-wide steps take 4, which Triton loads
        # ahead into registers (local sm_90 compile: 227 registers a thread at two stages), and
        # 256 columns take 4, which it copies asynchronously with the words (249 registers).
        GemmConfig(64, 128, 128, num_warps=4, num_stages=2),
        GemmConfig(64, 256, 64, num_warps=4, num_stages=3),
        # The 8-warp 128-row tiles fit one program an SM (bench/scripts/gemm_kloop_sass.py, Triton
        # 3.6: 167-255 registers a thread), and one is launched.
        GemmConfig(128, 128, 64, num_warps=8, num_stages=3, programs_per_sm=1),
        # 4.9 instructions per weight and thread in its K loop against 6.1 for 128 x 128 (local sm_90 compile).
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, programs_per_sm=1),
        # Tall tiles transposed: the decoded weights take the warp-group MMA's 64-row side (local
        # sm_90 compile, K step of the 128-row tile: 183 instructions against 246 unswapped; the
        # 64-row tile 270 against 352). The 64-row tile takes 207 registers a thread with one
        # multiply per pair (Triton 3.6), so two programs fit an SM, not three.
        GemmConfig(64, 128, 64, num_warps=4, num_stages=4, swap_ab=True, programs_per_sm=2),
        GemmConfig(128, 128, 64, num_warps=8, num_stages=3, swap_ab=True, programs_per_sm=1),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=3, programs_per_sm=1),
    ),
}
SKIP_FACTOR = 5.0  # --quick: a config whose probe call exceeds this times the best so far is not timed


def _random_bf16(shape: tuple[int, ...], scale: float, device: torch.device) -> torch.Tensor:
    return (torch.randn(shape, device=device) * scale).bfloat16()


def quantize_by_expert(weights: torch.Tensor, format: str) -> QuantizedTensor:
    """Quantize ``[G, N, K]`` one expert at a time (bounded temporaries at real sizes)."""
    # In the layout a pool holds them in, which the kernels read.
    parts = [QuantizedTensor.quantize(weights[expert], format).in_layout(pool_layout(format))
             for expert in range(weights.shape[0])]
    # A stack is contiguous: in_layout stores mxfp4's scales columns-fastest again.
    stacked = QuantizedTensor(format, torch.stack([part.values for part in parts]),
                              torch.stack([part.scales for part in parts]), pool_layout(format))
    return stacked.in_layout(pool_layout(format))


def _interleaved(arms: dict[str, Callable[[], object]], device: torch.device, rounds: int) -> dict[str, dict[str, float]]:
    """Median, fastest and slowest of ``rounds * REPLAYS`` graph replays of each arm (four calls per
    replay), the arms' replays interleaved (:func:`flatep.bench.timing.time_interleaved`)."""
    timings = time_interleaved(list(arms.values()), device, warmup=1, iters=rounds * REPLAYS, graph=True, calls=4)
    return {name: {"us": timing.median, "min_us": timing.min, "max_us": timing.max} for name, timing in zip(arms, timings)}


def _rowwise_fp8_arm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``torch._scaled_grouped_mm`` on fp8 with row-wise scales (one per activation row, one per
    weight output row): the layout it takes, not the checkpoints' 128x128 blocks, so a reference
    point; activations are quantized once outside the timed call."""
    scales, values = [], []
    for expert in range(weights.shape[0]):
        weight = weights[expert].float()
        scale = weight.abs().amax(-1).clamp_min(1e-12) / 448.0
        scales.append(scale)
        values.append((weight / scale[:, None]).to(torch.float8_e4m3fn))
    weight_scales, weight_values = torch.stack(scales), torch.stack(values)
    row_scales = rows.float().abs().amax(-1).clamp_min(1e-12) / 448.0
    row_values = (rows.float() / row_scales[:, None]).to(torch.float8_e4m3fn)
    return lambda: torch._scaled_grouped_mm(row_values, weight_values.transpose(-2, -1), row_scales, weight_scales,
                                            offs=offsets, out_dtype=torch.bfloat16)


def _kernel(format: str):
    return fp8_grouped_mm_triton if format == "fp8" else mxfp4_grouped_mm_triton


def _candidates(format: str, rows_per_expert: int, device: torch.device) -> list[GemmConfig]:
    """The format's candidates (and its default config) that run on ``device``, without row tiles
    taller than twice a group (mostly padding)."""
    configs = [*CANDIDATES[format], default_config(rows_per_expert, 1, format, device)]
    return [config for index, config in enumerate(configs)
            if config.block_m <= max(16, 2 * rows_per_expert) and config not in configs[:index]
            and (not config.wgmma or fp8_wgmma.available(device))]


def experts_cell(
    model: str, format: str, hidden: int, intermediate: int, experts: int, rows_per_expert: int,
    w13: torch.Tensor, w2: torch.Tensor, q13: QuantizedTensor, q2: QuantizedTensor, device: torch.device, rounds: int,
) -> dict:
    """One (model, format, rows per expert) cell: per-GEMM and whole-step times, bf16 and packed."""
    rows = experts * rows_per_expert
    offsets = (torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows_per_expert).to(torch.int32)
    x = _random_bf16((rows, hidden), 1.0, device)
    activated = _random_bf16((rows, intermediate), 1.0, device)
    route_weights = torch.rand(rows, device=device)
    result: dict = {"model": model, "format": format, "hidden": hidden, "intermediate": intermediate,
                    "experts": experts, "rows_per_expert": rows_per_expert, "rows": rows}
    # Correctness of the GPU kernels against the torch reference on the first groups.
    few = min(4, experts)
    end = few * rows_per_expert
    for name, rows_in, packed in (("w13", x, q13), ("w2", activated, q2)):
        kernel_out = _kernel(format)(rows_in[:end], packed.values[:few], packed.scales[:few], offsets[:few])
        reference = quantized_grouped_mm(rows_in[:end], packed[:few], offsets[:few], backend="torch")
        result[f"{name}_relative_error"] = float((kernel_out.float() - reference.float()).norm() / reference.float().norm())
    for name, rows_in, plain, packed in (("w13", x, w13, q13), ("w2", activated, w2, q2)):
        arms: dict[str, Callable[[], object]] = {
            "bf16": lambda rows_in=rows_in, plain=plain: torch._grouped_mm(rows_in, plain.transpose(-2, -1), offs=offsets),
        }
        for config in _candidates(format, rows_per_expert, device):
            arms[f"{format} {config.label}"] = (lambda rows_in=rows_in, packed=packed, config=config:
                                                _kernel(format)(rows_in, packed.values, packed.scales, offsets, config))
        rowwise = None
        if format == "fp8":
            try:
                rowwise = _rowwise_fp8_arm(rows_in, plain, offsets)
                check = rowwise()[:end].float()
                exact = torch._grouped_mm(rows_in[:end], plain[:few].transpose(-2, -1), offs=offsets[:few]).float()
                result[f"{name}_rowwise_relative_error"] = float((check - exact).norm() / exact.norm())
                arms["scaled_grouped_mm rowwise"] = rowwise
            except (RuntimeError, TypeError, NotImplementedError) as error:  # not every build has it
                result[f"{name}_rowwise_error"] = str(error)[:300]
        times = _interleaved(arms, device, rounds)
        packed_arms = [arm for arm in times if arm not in ("bf16", "scaled_grouped_mm rowwise")]
        best = min(packed_arms, key=lambda arm: times[arm]["us"])
        result[name] = {"bf16_us": times["bf16"], "packed_us": times[best], "best_config": best,
                        "configs": {arm: times[arm]["us"] for arm in packed_arms},
                        "ratio": times[best]["us"] / times["bf16"]["us"]}
        if "scaled_grouped_mm rowwise" in times:
            result[name]["rowwise_scaled_grouped_mm_us"] = times["scaled_grouped_mm rowwise"]
            result[name]["rowwise_ratio"] = times["scaled_grouped_mm rowwise"]["us"] / times["bf16"]["us"]
        del rowwise
    result["default_config"] = str(default_config(rows, experts, format, device))
    step = _interleaved({
        "bf16": lambda: grouped_swiglu(x, route_weights, w13, w2, offsets, backend="triton"),
        format: lambda: grouped_swiglu(x, route_weights, q13, q2, offsets, backend="triton"),
    }, device, rounds)
    result["experts_step"] = {"bf16_us": step["bf16"], "packed_us": step[format],
                              "ratio": step[format]["us"] / step["bf16"]["us"]}
    result["best_gemms_ratio"] = (result["w13"]["packed_us"]["us"] + result["w2"]["packed_us"]["us"]) / (
        result["w13"]["bf16_us"]["us"] + result["w2"]["bf16_us"]["us"])
    return result


def model_weights(
    model: str, format: str, device: torch.device,
) -> tuple[int, int, int, torch.Tensor, torch.Tensor, QuantizedTensor, QuantizedTensor]:
    """``(hidden, intermediate, experts, w13, w2, q13, q2)`` of one rank of ``model`` at EP8: random
    bf16 weights (``w13 [experts, 2*intermediate, hidden]``, ``w2 [experts, hidden, intermediate]``,
    N(0, 1/fan_in)) and their ``format`` packing in the pools' layout."""
    config = preset(model, ranks=8)
    hidden, intermediate, experts = config.hidden, config.intermediate, config.experts_per_rank
    w13 = _random_bf16((experts, 2 * intermediate, hidden), hidden**-0.5, device)
    w2 = _random_bf16((experts, hidden, intermediate), intermediate**-0.5, device)
    return hidden, intermediate, experts, w13, w2, quantize_by_expert(w13, format), quantize_by_expert(w2, format)


def model_cells(model: str, format: str, device: torch.device, rounds: int) -> list[dict]:
    hidden, intermediate, experts, w13, w2, q13, q2 = model_weights(model, format, device)
    cells = []
    for rows_per_expert in ROWS_PER_EXPERT:
        cell = experts_cell(model, format, hidden, intermediate, experts, rows_per_expert, w13, w2, q13, q2, device, rounds)
        print(f"[{time.perf_counter() - STARTED:.0f} s] {model} {format} rows/expert={rows_per_expert}: w13 {cell['w13']['ratio']:.2f}x, w2 "
              f"{cell['w2']['ratio']:.2f}x, step {cell['experts_step']['ratio']:.2f}x of bf16 "
              f"(errors {cell['w13_relative_error']:.1e}, {cell['w2_relative_error']:.1e})", flush=True)
        cells.append(cell)
    del w13, w2, q13, q2
    torch.cuda.empty_cache()
    return cells


def quick_cells(
    model: str, format: str, hidden: int, intermediate: int, experts: int, w13: torch.Tensor, w2: torch.Tensor,
    q13: QuantizedTensor, q2: QuantizedTensor, device: torch.device, rows_per_expert: tuple[int, ...] = ROWS_PER_EXPERT,
    deadline: float = float("inf"),
) -> list[dict]:
    """One entry per (rows per expert, GEMM, arm): bf16 ``torch._grouped_mm``, then (mxfp4) the
    weights decoded whole into bf16 for ``torch._grouped_mm``
    (:func:`flatep.kernels.mxfp4_dequant.mxfp4_grouped_mm_bf16`), then each candidate config.

    Each entry holds ``format``, ``rows_per_expert``, ``gemm`` (``w13``: ``[rows, H] -> [rows, 2I]``;
    ``w2``: ``[rows, I] -> [rows, H]``), ``path`` (``bf16``, ``tiles`` or ``through_bf16``),
    ``config`` (:class:`GemmConfig`'s fields for ``tiles``, else ``None``), ``us`` (graph time of
    one call), ``ratio`` (``us`` over bf16's), ``relative_error``
    (packed: the first four groups against the torch reference path) and ``skipped`` (why ``us`` is
    only one eager call: its probe exceeded :data:`SKIP_FACTOR` times the best, or ``deadline``, a
    ``time.perf_counter`` value, passed; then ``us`` is ``None`` if not even probed).
    """
    entries = []
    for per_expert in rows_per_expert:
        rows = experts * per_expert
        offsets = (torch.arange(1, experts + 1, device=device, dtype=torch.int32) * per_expert).to(torch.int32)
        few = min(4, experts)
        end = few * per_expert
        for gemm, rows_in, plain, packed in (("w13", _random_bf16((rows, hidden), 1.0, device), w13, q13),
                                             ("w2", _random_bf16((rows, intermediate), 1.0, device), w2, q2)):
            base = {"model": model, "format": format, "rows_per_expert": per_expert, "gemm": gemm}
            bf16_us = time_us(lambda: torch._grouped_mm(rows_in, plain.transpose(-2, -1), offs=offsets), device,
                              warmup=1, iters=REPLAYS, graph=True, calls=2)
            entries.append({**base, "path": "bf16", "config": None, "us": bf16_us, "ratio": 1.0, "relative_error": None})
            reference = quantized_grouped_mm(rows_in[:end], packed[:few], offsets[:few], backend="torch").float()
            best = float("inf")
            timed = []
            arms = [("tiles", config, (lambda rows_in=rows_in, packed=packed, config=config:
                                       _kernel(format)(rows_in, packed.values, packed.scales, offsets, config)))
                    for config in _candidates(format, per_expert, device)]
            if format == "mxfp4":  # first, so that a deadline leaves it timed
                arms.insert(0, ("through_bf16", None, lambda rows_in=rows_in, packed=packed:
                                mxfp4_grouped_mm_bf16(rows_in, packed.values, packed.scales, offsets)))
            for path, config, call in arms:
                entry = {**base, "path": path, "config": None if config is None else dataclasses.asdict(config),
                         "us": None, "ratio": None, "relative_error": None}
                entries.append(entry)
                if time.perf_counter() > deadline:
                    entry["skipped"] = "deadline"
                    continue
                out = call()[:end].float()  # compiles it, and its first groups are checked
                entry["relative_error"] = float((out - reference).norm() / reference.norm())
                probe = time_us(call, device, warmup=0, iters=1)
                if probe > SKIP_FACTOR * best:
                    entry.update(us=probe, ratio=probe / bf16_us, skipped=f"probe over {SKIP_FACTOR:g}x the best")
                    continue
                entry["us"] = time_us(call, device, warmup=1, iters=REPLAYS, graph=True, calls=2)
                entry["ratio"] = entry["us"] / bf16_us
                best = min(best, entry["us"])
                timed.append(entry)
            winner = min(timed, key=lambda entry: entry["us"], default=None)
            print(f"[{time.perf_counter() - STARTED:.0f} s] {model} {format} rows/expert={per_expert} {gemm}: bf16 "
                  f"{bf16_us:.1f} us, best " + (f"{winner['us']:.1f} us ({winner['ratio']:.2f}x) {arm_label(winner)}"
                                                if winner else "none"),
                  flush=True)
    return entries


def arm_label(entry: dict) -> str:
    """A quick-sweep entry's arm: ``bf16``, ``through bf16`` or its tile config's label."""
    return GemmConfig(**entry["config"]).label if entry["path"] == "tiles" else entry["path"].replace("_", " ")


def best_configs(entries: list[dict]) -> list[dict]:
    """Per (model, format, rows per expert, GEMM): the fastest fully timed packed arm (``path`` and
    ``config``), and per (model, format, rows per expert) the ratio of both GEMMs together with
    their best arms."""
    best: dict[tuple, dict] = {}
    bf16: dict[tuple, float] = {}
    for entry in entries:
        key = (entry["model"], entry["format"], entry["rows_per_expert"], entry["gemm"])
        if entry["path"] == "bf16":
            bf16[key] = entry["us"]
        elif entry["us"] is not None and "skipped" not in entry and (key not in best or entry["us"] < best[key]["us"]):
            best[key] = entry
    summary = [{"model": key[0], "format": key[1], "rows_per_expert": key[2], "gemm": key[3], "path": entry["path"],
                "config": entry["config"],
                "us": entry["us"], "ratio": entry["ratio"], "relative_error": entry["relative_error"]}
               for key, entry in best.items()]
    for model, format, per_expert in dict.fromkeys(key[:3] for key in best):
        keys = [(model, format, per_expert, gemm) for gemm in ("w13", "w2")]
        if all(key in best for key in keys):
            summary.append({"model": model, "format": format, "rows_per_expert": per_expert, "gemm": "w13+w2",
                            "ratio": sum(best[key]["us"] for key in keys) / sum(bf16[key] for key in keys)})
    return summary


PUSH_MODELS = (("kimi-k2", ("bf16", "fp8")), ("kimi-k3", ("bf16", "mxfp4")))


def push_cells(
    device: torch.device, rounds: int, borrowed: int = 8, models: tuple[tuple[str, tuple[str, ...]], ...] = PUSH_MODELS,
    sizes: tuple[int, int] | None = None,
) -> list[dict]:
    """Push of ``borrowed`` experts from rank 1's home pool into rank 0's slots, per format (the
    first format of each model is the baseline of its ratios); ``sizes`` ``(H, I)`` overrides the
    models' shapes (for small checks)."""
    cells = []
    for model, formats in models:
        shape = preset(model, ranks=8)
        hidden, intermediate = sizes or (shape.hidden, shape.intermediate)
        config = EPConfig(ranks=2, experts=2 * borrowed, top_k=2, hidden=hidden, intermediate=intermediate, capacity=16)
        group = init_group("local", ranks=2, device=device)
        slot_experts = torch.full((2, borrowed), -1, dtype=torch.int32, device=device)
        slot_experts[0] = torch.arange(borrowed, 2 * borrowed, dtype=torch.int32, device=device)
        pools = {}
        for format in formats:
            pool = ExpertPool(config, group, torch.bfloat16, weights=format)
            for name in pool.names:
                pool.home(name).view(torch.uint8).random_(0, 120)  # finite bytes (values are not read)
            pools[format] = pool
        times = _interleaved({format: (lambda pool=pool: pool.push(slot_experts)) for format, pool in pools.items()},
                             device, rounds)
        for format, pool in pools.items():
            cells.append({"model": model, "format": format, "expert_bytes": pool.expert_nbytes(),
                          "us_per_expert": times[format]["us"] / borrowed,
                          "min_us_per_expert": times[format]["min_us"] / borrowed,
                          "max_us_per_expert": times[format]["max_us"] / borrowed})
        base = cells[-len(formats)]
        for cell in cells[-len(formats):]:
            cell["time_ratio"] = cell["us_per_expert"] / base["us_per_expert"]
            cell["byte_ratio"] = cell["expert_bytes"] / base["expert_bytes"]
            print(f"[{time.perf_counter() - STARTED:.0f} s] push {model} {cell['format']}: {cell['expert_bytes'] / 1e6:.1f} MB/expert, "
                  f"{cell['us_per_expert']:.1f} us/expert (time {cell['time_ratio']:.2f}x, bytes {cell['byte_ratio']:.2f}x)",
                  flush=True)
        del pools, group
        torch.cuda.empty_cache()
    return cells


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="quant_bench.json", help="JSON file to write")
    parser.add_argument("--rounds", type=int, default=3, help="replays per arm, in rounds of 10, interleaved across the arms")
    parser.add_argument("--quick", action="store_true", help="only the GEMMs, bf16 against each candidate config")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="--quick: seconds after which the configs not yet started are skipped")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS_PER_EXPERT),
                        help="--quick: rows per expert of the cells (e.g. 18 32: Kimi-K3 decode at s = 128)")
    parser.add_argument("--formats", nargs="+", default=["fp8", "mxfp4"], choices=["fp8", "mxfp4"],
                        help="--quick: the formats to sweep (fp8 on Kimi-K2, mxfp4 on Kimi-K3)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flatep.quant.bench needs a CUDA GPU")
    device = torch.device("cuda")
    started = STARTED
    torch.manual_seed(0)
    if args.quick:
        entries = []
        for model, format in (("kimi-k2", "fp8"), ("kimi-k3", "mxfp4")):
            if format not in args.formats:
                continue
            weights = model_weights(model, format, device)
            entries += quick_cells(model, format, *weights, device, tuple(args.rows), deadline=started + args.budget)
            del weights
            torch.cuda.empty_cache()
        report = {"device": device_name(device), "mode": "quick",
                  "timing": f"CUDA graph of 2 calls, median of {REPLAYS} replays; one round",
                  "best": best_configs(entries), "entries": entries}
        report["seconds"] = time.perf_counter() - started
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)
        print(f"wrote {args.out} in {report['seconds']:.0f} s")
        return
    report = {"device": device_name(device), "copy_ceiling_gbps": copy_ceiling_gbps(device),
              "timing": "CUDA graph of 4 calls, median of 10 replays per round; median and spread over rounds",
              "experts": model_cells("kimi-k2", "fp8", device, args.rounds) + model_cells("kimi-k3", "mxfp4", device, args.rounds),
              "push": push_cells(device, args.rounds)}
    report["seconds"] = time.perf_counter() - started
    with open(args.out, "w") as file:
        json.dump(report, file, indent=1)
    print(f"wrote {args.out} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
