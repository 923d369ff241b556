"""Shared test inputs: fresh random data for every check, never zeros."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import flatep.kernels.quant_gemm as quant_gemm
from flatep import CostProfile, EPConfig
from flatep.quant import QuantizedTensor, dequantize_fp8_activations, quantize_fp8_activations
from flatep.routing import adversarial_topk, skewed_topk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_BACKENDS = ["torch", "triton"]


def make_inputs(config: EPConfig, tokens: int, routing: str | float, dtype: torch.dtype, seed: int = 0):
    """``x [R, s, H]``, ``topk_ids [R, s, K]``, ``topk_weights [R, s, K]``, ``w13``, ``w2`` on DEVICE."""
    generator = torch.Generator().manual_seed(seed)
    ranks, experts, top_k = config.ranks, config.experts, config.top_k
    if isinstance(routing, str):
        ids = adversarial_topk(routing, ranks, experts, top_k, tokens)
    else:
        ids = skewed_topk(ranks, experts, top_k, tokens, routing, seed=seed)
    x = torch.randn(ranks, tokens, config.hidden, generator=generator)
    weights = torch.rand(ranks, tokens, top_k, generator=generator) + 0.1
    w13 = torch.randn(experts, 2 * config.intermediate, config.hidden, generator=generator) * config.hidden**-0.5
    w2 = torch.randn(experts, config.hidden, config.intermediate, generator=generator) * config.intermediate**-0.5
    to = dict(device=DEVICE)
    return x.to(dtype=dtype, **to), ids.to(**to), weights.to(**to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to)


def dense_fp8_activations(x, ids, route_weights, w13, w2):
    """The fp8 experts' own function: dense, fp32, with both GEMMs' inputs quantized like the layer's."""
    def quantized(rows):
        return dequantize_fp8_activations(*quantize_fp8_activations(rows.bfloat16()))

    tokens = x.reshape(-1, x.shape[-1])
    ids, route_weights = ids.reshape(tokens.shape[0], -1), route_weights.reshape(tokens.shape[0], -1).float()
    out = torch.zeros(tokens.shape, device=x.device)
    intermediate = w2.shape[-1]
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        hidden = quantized(tokens[token]) @ w13[expert].T
        hidden = hidden.bfloat16().float()  # the gate/up GEMM's output is rounded to the shard's dtype
        activated = torch.nn.functional.silu(hidden[:, :intermediate]) * hidden[:, intermediate:]
        # The layer folds the route weight in before the down GEMM, so its rows are quantized weighted.
        activated = (activated * route_weights[token, slot].unsqueeze(-1)).bfloat16()
        out.index_add_(0, token, quantized(activated) @ w2[expert].T)
    return out.view(x.shape)


def random_expert_weights(config: EPConfig, format: str, seed: int, device: torch.device = DEVICE):
    """``(w13 [E, 2I, H], w2 [E, H, I])`` drawn from ``seed`` (unit-variance outputs), in ``format``:
    fp32 or bf16 tensors, or :class:`flatep.quant.QuantizedTensor` packed as fp8 or mxfp4."""
    generator = torch.Generator().manual_seed(seed)
    experts, hidden, intermediate = config.experts, config.hidden, config.intermediate
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator).to(device) * hidden**-0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator).to(device) * intermediate**-0.5
    if format in ("fp8", "mxfp4"):
        return QuantizedTensor.quantize(w13, format), QuantizedTensor.quantize(w2, format)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[format]
    return w13.to(dtype), w2.to(dtype)


def borrowing_cost(link_gbps: float = 1e6) -> CostProfile:
    """A profile under which ``policy="auto"`` borrows experts wherever that flattens the step (a
    link of ``1e6`` GB/s: moving weights nearly free) or never does (``1e-3``)."""
    return CostProfile(link_gbps=link_gbps, hbm_gbps=1e6, gemm_tflops=1e-4, group_us=1e-3, push_us=1e-3, tile_rows=1)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf."""
    out, reference = out.double(), reference.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - reference).norm() / reference.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


ROOT = Path(__file__).resolve().parents[1]


# gloo's worker threads can abort a process at interpreter exit, after its work is done ("terminate
# called without an active exception"), when a process group is torn down during the interpreter's
# final garbage collection. Seen rarely under load on the 2-core CPU runner (groups now let go of
# their process group on close(), which removed the common case); the root cause is not found.
# A run whose failed processes all died only that way is run once more; any other failure, or the
# same abort twice, fails the test.
EXIT_ABORT = "terminate called without an active exception"


def died_only_at_exit(codes: list[int], logs: list[str]) -> bool:
    """Whether every failed process aborted at exit with :data:`EXIT_ABORT` as its last words."""
    failed = [(code, log) for code, log in zip(codes, logs) if code != 0]
    return bool(failed) and all(code in (-6, 134) and log.strip().endswith(EXIT_ABORT) for code, log in failed)


def launch_workers(module: str, world: int, arguments: list[str], timeout: float) -> str:
    """Run ``world`` copies of ``python -m module`` as ranks of one group; fail the test if any
    times out or exits non-zero (see :data:`EXIT_ABORT` for the one rerun). Returns their output,
    rank by rank."""
    for attempt in range(2):
        codes, logs = _launch_once(module, world, arguments, timeout)
        if attempt == 1 or not died_only_at_exit(codes, logs):
            break
        for argument in arguments:  # a file store left by the first run would confuse the second
            if argument.startswith("file://"):
                Path(argument[len("file://"):]).unlink(missing_ok=True)
    output = "\n".join(logs)
    assert all(code == 0 for code in codes), output
    return output


def _launch_once(module: str, world: int, arguments: list[str], timeout: float) -> tuple[list[int], list[str]]:
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", module, *arguments]
    workers = [
        subprocess.Popen(command, cwd=ROOT, env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    logs = []
    try:
        for worker in workers:
            logs.append(worker.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
        pytest.fail(f"{world} workers did not finish within {timeout} s:\n" + "\n".join(logs))
    return [worker.returncode for worker in workers], logs


class HostReadGuard(TorchFunctionMode):
    """Raises ``RuntimeError`` on any torch call inside that would read a tensor back to the host
    (a synchronisation on CUDA), also where the tensors are on the CPU: values to Python
    (``tolist``, ``item``, ``bool``/``int``/``float``), copies to the CPU, and the operations whose
    output size depends on values (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
    ``repeat_interleave`` without ``output_size``, indexing with a boolean mask).

    A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: the collective transport's
    tests use it where two processes cannot share one GPU under NCCL.
    """

    READS = {
        torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
        torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.nonzero, torch.Tensor.nonzero,
        torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.bincount,
        torch.Tensor.bincount,
    }
    INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS:
            raise RuntimeError(f"host read: {getattr(func, '__name__', func)}")
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and kwargs.get("output_size") is None:
            raise RuntimeError("host read: repeat_interleave without output_size")
        if func is torch.Tensor.to and any(
            (isinstance(a, torch.device) and a.type == "cpu") or (isinstance(a, str) and a == "cpu")
            for a in (*args[1:], *kwargs.values())
        ):
            raise RuntimeError("host read: a copy to the CPU")
        if func in self.INDEXING and len(args) > 1:
            index = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise RuntimeError("host read: indexing with a boolean mask")
        return func(*args, **kwargs)


def second_pass_flags(monkeypatch) -> list[torch.Tensor]:
    """Patches the mxfp4 GEMM kernel (``monkeypatch``) to record each launch's one-element
    second-pass flag (int32 on the device; read it after the launches)."""
    kernel, flags = quant_gemm._mxfp4_grouped_kernel, []
    flag_index = kernel.arg_names.index("redo_ptr")

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs["ONE_MULTIPLY"]:  # the second pass reads the same flag
                    flags.append(args[flag_index])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(quant_gemm, "_mxfp4_grouped_kernel", Recorder())
    return flags


def write_compiled(compiled, directory: str) -> None:
    """A kernel compiled for sm_90 (``triton.compile``'s result) into ``directory``: its PTX, cubin
    and shared-memory bytes, for :func:`sm90_build`."""
    Path(directory, "kernel.ptx").write_text(compiled.asm["ptx"])
    Path(directory, "kernel.cubin").write_bytes(compiled.asm["cubin"])
    Path(directory, "shared").write_text(str(compiled.metadata.shared))


def sm90_build(code: str, directory: Path) -> tuple[int, str, str, str]:
    """Runs ``code`` (Python that compiles a Gluon kernel for sm_90 and :func:`write_compiled` it into
    ``directory``) in a process of its own without ``TRITON_INTERPRET``: the CPU test session's
    interpreter replaces Triton's functions, which a compile for a real target cannot call. Returns
    the kernel's shared-memory bytes, its PTX, its SASS and its resource usage (Triton's bundled
    cuobjdump; the test is skipped where there is none)."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], env=environment, cwd=Path(__file__).parents[1], check=True,
                   capture_output=True, timeout=300)
    shared, ptx = int((directory / "shared").read_text()), (directory / "kernel.ptx").read_text()
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not os.access(cuobjdump, os.X_OK):
        pytest.skip("no cuobjdump bundled with this Triton")
    cubin = str(directory / "kernel.cubin")
    sass, usage = (subprocess.run([str(cuobjdump), flag, cubin], capture_output=True, text=True, check=True).stdout
                   for flag in ("-sass", "-res-usage"))
    return shared, ptx, sass, usage
