"""Sampling: the backend protocol and its two kinds, `hf` (the batched scheduler) and `vllm`."""
