#!/usr/bin/env bash
# The demo-sized preference and distillation runs that README reports, on SmolLM2-135M-Instruct.
#   bash scripts/preference_demos.sh [OUT_DIR] [dpo kto distill]
# Needs the model `treadle demo` converts once (~/.cache/treadle/models/SmolLM2-135M-Instruct) and the
# venv of scripts/setup.sh. Starts its own local stack (home OUT_DIR/stack), runs each recipe with
# `time`, prints the before/after metrics, and stops the stack. distill's teacher is dpo's last sampler
# training state, so run dpo first (or pass TEACHER_PATH=treadle://...).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/preference_demo}
shift || true
RECIPES=${*:-dpo kto distill}
source scripts/smollm2_stack.sh

COMMON=(--base_model SmolLM2-135M-Instruct --seed 0 --eval_every 0)
for recipe in $RECIPES; do
  case $recipe in
    dpo) args=(--pairs 80 --heldout_pairs 32 --reference forward --steps 10 --batch_size 8 --learning_rate 2e-4 --save_every 10) ;;
    kto) args=(--examples 160 --heldout_pairs 32 --reference forward --steps 10 --batch_size 16 --learning_rate 2e-4 --save_every 10) ;;
    distill)
      teacher=${TEACHER_PATH:-$(grep -o '"state_path": *"treadle://[^"]*"' "$OUT/dpo/checkpoints.jsonl" | tail -1 | sed 's/.*"\(treadle:[^"]*\)"/\1/')}
      args=(--teacher_path "$teacher" --steps 8 --prompts_per_batch 8 --samples_per_prompt 4 --eval_prompts 16 --learning_rate 2e-4 --save_every 8) ;;
    *) echo "unknown recipe $recipe" >&2; exit 2 ;;
  esac
  echo "== $recipe: ${args[*]}"
  start=$(date +%s)
  "$PY" -m treadle.recipes.$recipe "${COMMON[@]}" --log_dir "$OUT/$recipe" "${args[@]}"
  echo "== $recipe took $(( $(date +%s) - start )) s"
done
