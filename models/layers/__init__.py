"""Building blocks of model files: tensor-parallel linear and embedding layers, norms,
rotary embeddings, activations, the logits processor and the attention layer."""
