"""The demo: GRPO visibly teaches SmolLM2-135M-Instruct arithmetic on a CPU, through the SDK."""
