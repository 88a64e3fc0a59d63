"""Model files (vLLM's contract), their layers, weight loading and the model registry."""

# Registers the `compilecore::unified_attention_with_output` op on import.
import models.layers.attention  # noqa: F401
