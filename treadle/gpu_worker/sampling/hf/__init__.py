"""The `hf` sampler backend: continuous batching on the PeftModel that trains, batch-invariant."""
