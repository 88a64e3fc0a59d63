"""The wrapper Inductor writes for our pieces calls its C++ kernels through one hook.

A CPU-graph capture (`cpu_graph.py`) has to see every C function a forward calls. Aten
ops and our native ops pass the dispatcher, where a mode sees them; Inductor's own C++
kernels do not: the generated wrapper calls each one by name, from Python. So while our
backend compiles, the CPU's wrapper code generator (registered through Inductor's
backend registry, `register_backend_for_device`) writes those calls through
`cpu_graph.kernel_call`, which records them when this thread is capturing:

    Inductor's wrapper:  cpp_fused_add_mean_mul_rsqrt_0(buf0, arg1_1, arg2_1, ...)
    ours:                _cc_kernel_call(cpp_fused_add_mean_mul_rsqrt_0, buf0, arg1_1, ...)

No module global is patched and no profile hook runs: a kernel call the capture could
miss is not written. The registration is swapped in around our compiles only, so other
`torch.compile` users in the process get Inductor's own wrapper; a post-grad pass that
changes nothing but Inductor's cache key (`CODEGEN_KEY`) comes with it, so Inductor's
cache never hands our compiles code written without the hook (or hands others ours).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["CODEGEN_KEY", "HOOK", "recorded_kernel_calls"]

HOOK = "_cc_kernel_call"
CODEGEN_KEY = "wrapper: C++ kernels through compilecore.cpu_graph.kernel_call, v1"
_IMPORT = f"from compilecore.cpu_graph import kernel_call as {HOOK}"

_LOCK = threading.Lock()  # the registry is process-wide: one swap at a time


@dataclasses.dataclass
class _Swap:
    depth: int = 0  # compiles in progress (two engines may compile on two threads)
    saved: Any = None  # Inductor's own CPU registration, put back by the last one out


_SWAP = _Swap()


class _CodegenKey(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return CODEGEN_KEY


class _HookedCalls:
    """Mixed into Inductor's Python wrapper codegen (and its subgraph variant, whose code
    lands in the parent's module)."""

    def wrap_kernel_call(self, name: str, call_args: list[str]) -> str:
        return super().wrap_kernel_call(HOOK, [name, *call_args])


@contextlib.contextmanager
def recorded_kernel_calls() -> Iterator[None]:
    """Compile in this block with the CPU wrapper that calls kernels through the hook."""
    from torch._inductor.codegen import common

    with _LOCK:
        if _SWAP.depth == 0:
            common.init_backend_registration()
            _SWAP.saved = _registration(common)
            codegen, custom_pass, custom_config = _SWAP.saved
            hooked = dataclasses.replace(codegen, wrapper_codegen=_hooked(codegen.wrapper_codegen))
            _register(common, hooked, custom_pass, custom_config)
        _SWAP.depth += 1
    try:
        with torch._inductor.config.patch(post_grad_custom_post_pass=_CodegenKey()):
            yield
    finally:
        with _LOCK:
            _SWAP.depth -= 1
            if _SWAP.depth == 0:
                _register(common, *_SWAP.saved)
                _SWAP.saved = None


def _registration(common: Any) -> tuple[Any, Any, Any]:
    """The CPU's registration as `register_backend_for_device` left it: its codegens, its
    custom pass and its codegen config."""
    passes = getattr(common, "custom_backend_passes", {})
    configs = getattr(common, "custom_backend_codegen_configs", {})
    return common.device_codegens["cpu"], passes.get("cpu"), configs.get("cpu")


def _register(common: Any, codegen: Any, custom_pass: Any, custom_config: Any) -> None:
    """Registers `codegen` for the CPU through Inductor's backend registry (the route
    out-of-tree backends take), each of its codegens under the parameter that names it in
    this torch's `register_backend_for_device`."""
    params = inspect.signature(common.register_backend_for_device).parameters
    kwargs = {f"device_{f.name}": getattr(codegen, f.name) for f in dataclasses.fields(codegen)}
    kwargs = {k: v for k, v in kwargs.items() if k in params}
    if "device_custom_pass" in params:
        kwargs["device_custom_pass"] = custom_pass
    if "device_custom_config" in params:
        kwargs["device_custom_config"] = custom_config
    common.register_backend_for_device("cpu", **kwargs)


def _hooked(base: Any) -> Any:
    from torch._inductor.codegen.wrapper import SubgraphPythonWrapperCodegen

    class Subgraph(_HookedCalls, SubgraphPythonWrapperCodegen):
        pass

    class Wrapper(_HookedCalls, base):
        def write_header(self) -> None:
            super().write_header()
            self.header.writeline(_IMPORT)

        @staticmethod
        def create(is_subgraph: bool, subgraph_name, parent_wrapper, *rest) -> Any:
            # Inductor's `create` names its own classes; ours must name these.
            if is_subgraph:
                return Subgraph(subgraph_name, parent_wrapper, *rest)
            return Wrapper()

    return Wrapper
