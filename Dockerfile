# One image for the worker, the gateway and flower. Build the GPU flavour with:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t treadle .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0
COPY pyproject.toml README.md ./
COPY treadle ./treadle
RUN pip install '.[worker,gateway]'
ENTRYPOINT ["treadle"]
