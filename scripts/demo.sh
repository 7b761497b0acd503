#!/usr/bin/env bash
# Sets up and runs the main job: GRPO teaches SmolLM2-135M-Instruct arithmetic on the local stack.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/treadle demo "$@"
