"""The `vllm` sampler backend: a vLLM engine in a child process of its own venv."""
