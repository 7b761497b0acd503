#!/usr/bin/env bash
# The demo-sized full fine-tuning SFT run that README reports: every weight of SmolLM2-135M-Instruct.
#   bash scripts/sft_full_demo.sh [OUT_DIR]
# Needs the model `treadle demo` converts once and the venv of scripts/setup.sh. The worker admits a full
# session only if its state (2.2 GB) and one micro-batch's estimated activations fit the host's available
# memory: 1,024-token micro-batches (2.9 GB of activations), not the CPU's default 4,096 (11.5 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/sft_full_demo}
export TREADLE_WORKER_MAX_TOKENS_PER_MICROBATCH=1024 TREADLE_WORKER_CHECKPOINT_EVERY=100
source scripts/smollm2_stack.sh
start=$(date +%s)
"$PY" -m treadle.recipes.sft --base_model SmolLM2-135M-Instruct --full --seed 0 --steps 10 --batch_size 4 \
  --max_length 256 --learning_rate 1e-5 --eval_every 0 --save_every 1000 --log_dir "$OUT/sft"
echo "== sft --full took $(( $(date +%s) - start )) s"
