"""Every Triton kernel of FlatEP reads only the globals a GPU compile accepts.

Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) lets a ``@triton.jit``
function read any module global, but compiling it for a GPU accepts only constexpr globals
(``tl.constexpr(...)``), modules, other jitted functions and ``triton.language`` objects, and raises
``NameError`` for the rest (an int global, say). This check mirrors that rule on the functions'
source, so such a kernel fails here rather than on the first GPU that runs it.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import flatep

# What @triton.jit makes: a JITFunction, or under TRITON_INTERPRET=1 (as the suite runs) an
# InterpretedFunction; both hold the Python function as ``.fn``.
JITTED = (triton.runtime.jit.JITFunction, InterpretedFunction)


def jitted_functions() -> list[tuple[str, object]]:
    """``(qualified name, function)`` of every ``@triton.jit`` function defined in a flatep module."""
    found = {}
    for module_info in pkgutil.walk_packages(flatep.__path__, "flatep."):
        if module_info.name.endswith("__main__"):  # runs the command line when imported
            continue
        try:
            module = importlib.import_module(module_info.name)
        except ImportError:  # an optional extra (transformers, vLLM) not installed
            continue
        for name, value in vars(module).items():
            if isinstance(value, JITTED) and value.fn.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return sorted(found.items())


def accepted_by_the_compiler(value: object) -> bool:
    """Triton's rule for a global a jitted function reads (``CodeGenerator``'s name lookup)."""
    return (
        isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype, *JITTED))
        or getattr(value, "__triton_builtin__", False)
        or getattr(value, "__module__", "").startswith("triton.language")
    )


def global_reads(function: types.FunctionType) -> set[str]:
    """Names the function's body reads and does not bind itself (arguments, assignments, loop
    targets); its decorator's arguments are Python, not kernel code."""
    definition = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    nodes = [node for statement in definition.body for node in ast.walk(statement)]
    bound = {arg.arg for arg in ast.walk(definition.args) if isinstance(arg, ast.arg)}
    bound |= {node.id for node in nodes if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    return {node.id for node in nodes if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)} - bound


KERNELS = jitted_functions()


def test_the_kernels_are_found():
    names = {name.rsplit(".", 1)[1] for name, _ in KERNELS}
    assert {"_push_kernel", "_swiglu_weighted_kernel", "_fp8_grouped_kernel", "_dispatch_kernel"} <= names
    assert len(KERNELS) > 40


@pytest.mark.parametrize("name, kernel", KERNELS, ids=[name for name, _ in KERNELS])
def test_a_kernel_reads_only_globals_a_gpu_compile_accepts(name, kernel):
    scope = kernel.fn.__globals__
    refused = sorted(read for read in global_reads(kernel.fn) if read in scope and not accepted_by_the_compiler(scope[read]))
    assert not refused, f"{name} reads globals a GPU compile refuses (make them tl.constexpr): {refused}"


def test_the_rule_refuses_a_plain_int_global():
    assert not accepted_by_the_compiler(128) and accepted_by_the_compiler(tl.constexpr(128))
