"""compilecore: torch.compile integration (decorator, piecewise backend, compile cache,
CUDA graphs), the engine config, the forward context and the parallel state."""

from compilecore.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
]
