"""The post-grad pass manager that the compile backend installs for every piece.

It is an Inductor `CustomGraphPass`: Inductor calls it on each piece's post-grad FX
graph, and its `uuid()` is part of Inductor's cache key, so a change of passes or of
their configuration never reuses a stale compiled artifact.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Sequence

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

logger = logging.getLogger("compilecore.passes")

GraphPass = Callable[[fx.Graph], int | None]


def source_hash(*objects: object) -> str:
    h = hashlib.sha256()
    for obj in objects:
        h.update(
            inspect.getsource(
                obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
            ).encode()
        )
    return h.hexdigest()


class PostGradPassManager(CustomGraphPass):
    def __init__(self, passes: Sequence[GraphPass] = (), config: dict | None = None):
        self.passes = list(passes)
        self.config = dict(config or {})
        self.match_counts: dict[str, int] = {}

    def __call__(self, graph: fx.Graph) -> None:
        for graph_pass in self.passes:
            name = getattr(graph_pass, "name", type(graph_pass).__name__)
            matched = graph_pass(graph)
            self.match_counts[name] = self.match_counts.get(name, 0) + int(matched or 0)
            logger.debug("pass %s matched %s sites", name, matched)

    def uuid(self) -> str:
        parts = [source_hash(PostGradPassManager), json.dumps(self.config, sort_keys=True)]
        parts += [getattr(p, "uuid", lambda p=p: source_hash(p))() for p in self.passes]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
