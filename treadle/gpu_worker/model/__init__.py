"""The base model a worker loads and what LoRA adapts on it: host, adapters, LoRA targets."""
