#!/usr/bin/env bash
# The demo-sized code RL runs that README reports, on SmolLM2-135M-Instruct.
#   bash scripts/code_rl_demo.sh [OUT_DIR] [SEED ...]        (default: runs/code_rl_demo, seeds 0 1)
# Needs the model `treadle demo` converts once (~/.cache/treadle/models/SmolLM2-135M-Instruct) and the
# venv of scripts/setup.sh; the sandbox needs root (a container is fine). Starts its own local stack (home
# OUT_DIR/stack), runs code_rl once per seed with `time`, prints the before/after figures, stops the stack.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/code_rl_demo}
shift || true
SEEDS=${*:-0 1}
source scripts/smollm2_stack.sh

ARGS=(--base_model SmolLM2-135M-Instruct --steps ${STEPS:-5} --groups_per_batch 4 --group_size 4 --max_tokens 128
      --temperature 0.8 --learning_rate 3e-4 --num_rollout_workers 4 --eval_every 0 --save_every 5)
for seed in $SEEDS; do
  echo "== seed $seed: ${ARGS[*]}"
  start=$(date +%s)
  "$PY" -m treadle.recipes.code_rl "${ARGS[@]}" --seed "$seed" --log_dir "$OUT/seed$seed"
  echo "== seed $seed took $(( $(date +%s) - start )) s"
done
