"""Training loops built only on the public SDK, short enough to read in one sitting and then edit.

Recipes (each runnable as `python -m treadle.recipes.<name> --help`):
  sft       chat SFT on JSONL conversations or HF datasets, assistant-only loss, pipelined submission
  math_rl   GRPO on synthetic arithmetic or GSM8K; importance_sampling / ppo / cispo; sync or async

The loop library they share: rendering (chat template + assistant mask), datums (SFT and RL
builders), advantages (GRPO, KL penalty), math_tasks, conversations, evaluation, off_policy
(staleness), run_log (metrics.jsonl, checkpoints.jsonl, resume, MLflow), plot (the PNG curve).
Nothing here imports torch or the worker.
"""
