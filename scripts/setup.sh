#!/usr/bin/env bash
# Creates .venv and installs treadle with every extra (idempotent; fast when already installed).
# torch is installed first and pinned: an unpinned torch would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check -e '.[all]'
# tinker-cookbook's own requirements cannot all be met from PyPI (tml-renderers); it runs with --no-deps.
pip install -q --disable-pip-version-check --no-deps tinker-cookbook==0.6.1
