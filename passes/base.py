"""What every pass is: a callable on a post-grad FX graph that returns how many sites it
rewrote, with a uuid that changes when its source or configuration changes."""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from typing import Any

import torch
from torch import fx
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode


class GraphPass:
    name = "graph_pass"
    # Other modules whose source shapes what the pass matches or emits (pattern math).
    depends_on: tuple[str, ...] = ()

    def __call__(self, graph: fx.Graph) -> int:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {}

    def uuid(self) -> str:
        h = hashlib.sha256()
        names = [cls.__module__ for cls in type(self).__mro__] + list(self.depends_on)
        for name in dict.fromkeys(names):  # the source of every module the pass is made of
            module = sys.modules.get(name)
            if module is None or name.split(".")[0] in ("builtins", "torch"):
                continue
            h.update(inspect.getsource(module).encode())
        h.update(json.dumps(self.config(), sort_keys=True, default=str).encode())
        return h.hexdigest()


class PatternPass(GraphPass):
    """A pass made of `register_replacement` patterns, registered once at construction
    (under a fake mode, so tracing the patterns runs no real kernels or collectives)."""

    def __init__(self) -> None:
        self.patterns = PatternMatcherPass(pass_name=self.name)
        with FakeTensorMode():
            self.register()

    def register(self) -> None:
        raise NotImplementedError

    def __call__(self, graph: fx.Graph) -> int:
        return self.patterns.apply(graph)


PATTERN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def trace_pattern(*args: Any, **kwargs: Any) -> fx.GraphModule:
    """`fwd_only`, then Inductor's own `view_to_reshape`: post-grad graphs (what the
    pattern is matched against) have every view turned into a reshape by then."""
    try:
        gm = fwd_only(*args, **kwargs)
    except ValueError as e:
        # The matcher retraces a candidate with its real shapes and treats RuntimeError as
        # "no match"; a shape this pattern cannot take (split sizes) raises ValueError.
        raise RuntimeError(f"pattern does not apply to these shapes: {e}") from e
    view_to_reshape(gm)
    return gm
