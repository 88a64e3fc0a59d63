"""FX/Inductor passes and the fused custom ops they emit (see the passes issue)."""
