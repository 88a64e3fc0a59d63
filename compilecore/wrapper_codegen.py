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
            _SWAP.saved = common.device_codegens["cpu"]
            hooked = _hooked(_SWAP.saved.wrapper_codegen)
            common.device_codegens["cpu"] = dataclasses.replace(_SWAP.saved, wrapper_codegen=hooked)
        _SWAP.depth += 1
    try:
        with torch._inductor.config.patch(post_grad_custom_post_pass=_CodegenKey()):
            yield
    finally:
        with _LOCK:
            _SWAP.depth -= 1
            if _SWAP.depth == 0:
                common.device_codegens["cpu"], _SWAP.saved = _SWAP.saved, None


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
