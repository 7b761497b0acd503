#!/usr/bin/env bash
# Sets up and runs the whole test suite. Tests start (and stop) their own Redis and S3 servers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# Two processes, each file whole in one of them (module fixtures and in-file order stay as written):
# most tests wait on their servers and workers, so two share the cores well.
exec .venv/bin/python -m pytest -q -n "${TREADLE_TEST_PROCESSES:-2}" --dist loadfile --durations=25 "$@"
