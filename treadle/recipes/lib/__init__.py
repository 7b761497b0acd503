"""What the recipes share, so that each recipe file holds only its own loop.

  loop               a run's session (fresh or resumed), its steps, the end of a step (eval, row, checkpoint), the summary
  run_log            the log directory: config.json, metrics.jsonl, checkpoints.jsonl, resume; mlflow_log mirrors it
  plot               the PNG curve of metrics.jsonl
  rendering          chat template rendering with the assistant-token mask, multi-turn continuations
  datums             SFT and RL datum builders (pre-shifted targets, weights, advantages)
  conversations      chat datasets (JSONL, JSON, parquet, HF); packing packs them into longer sequences
  math_tasks         synthetic arithmetic and GSM8K, with graders; evaluation: greedy held-out accuracy
  code_tasks         programming problems graded on unit tests in a `treadle.sandbox.Sandbox`
  advantages         GRPO advantages and the KL penalty
  off_policy, grpo   the GRPO recipes' groups: staleness, the problem stream, a step's group bookkeeping
  preference         what DPO and KTO share; preference_losses (their losses on numpy), preference_data

Nothing here imports torch or the worker (`tests/test_import_boundaries.py`).
"""
