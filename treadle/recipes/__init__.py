"""Training loops built only on the public SDK, short enough to read in one sitting and then edit.

Recipes, one file each (each runnable as `python -m treadle.recipes.<name> --help`):
  sft       chat SFT on JSONL conversations or HF datasets, assistant-only loss, pipelined submission
  math_rl   GRPO on synthetic arithmetic or GSM8K; importance_sampling / ppo / cispo; sync or async
  code_rl   GRPO on programming problems graded in a sandbox, with an optional check_solution tool turn
  dpo, kto  preference training with the loss computed on the client
  distill   on-policy distillation: the student samples, a teacher scores its tokens

What they share is the library `treadle.recipes.lib` (the loop, rendering, data, logging, evaluation).
Nothing here imports torch or the worker.
"""
