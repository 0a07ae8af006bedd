# syntax=docker/dockerfile:1
# Two images from one file (docs/deploy.md):
#   docker build --target gateway -t draftwise-gateway .   the gRPC front: no torch, starts in under a second
#   docker build --target worker  -t draftwise-worker  .   an engine with the embedded default model, CPU torch
# A CUDA worker takes torch from another PyTorch index:
#   docker build --target worker --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t draftwise-worker:cuda .
# Every flag of `draftwise gateway` / `draftwise worker` is also an environment variable (DRAFTWISE_PORT, ...).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1
# an unprivileged user; /run/draftwise holds the internal secret (a volume or a mounted Secret)
RUN useradd --create-home --uid 10001 draftwise && install -d -o draftwise -g draftwise -m 0700 /run/draftwise

# the draftwise wheel, built once for both images
FROM base AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY common ./common
COPY gateway ./gateway
COPY worker ./worker
COPY kernels ./kernels
COPY proto ./proto
RUN pip wheel --no-deps --wheel-dir /wheels .

# the gateway: its own dependencies only (no torch, no transformers), then the wheel without dependencies
FROM base AS gateway
COPY --from=wheel /wheels /wheels
RUN pip install "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" "protobuf>=7.35.1,<8" \
        "googleapis-common-protos>=1.63" "uvloop>=0.19" "structlog>=24.1" "prometheus-client>=0.20" "aiohttp>=3.9" \
    && pip install --no-deps /wheels/*.whl \
    && rm -rf /wheels
USER draftwise
# gRPC on 50051, the OpenAI-compatible HTTP endpoint on 8000, /metrics and /healthz on 9090
ENV DRAFTWISE_HOST=0.0.0.0 DRAFTWISE_PORT=50051 DRAFTWISE_HTTP_PORT=8000 DRAFTWISE_METRICS_HOST=0.0.0.0 \
    DRAFTWISE_METRICS_PORT=9090 DRAFTWISE_LOG_FORMAT=json
EXPOSE 50051 8000 9090
CMD ["draftwise", "gateway"]

# a worker: torch from PyTorch's CPU index by default (TORCH_INDEX_URL for CUDA), then the wheel and its dependencies
FROM base AS worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# g++: the CPU products' kernel is compiled on a worker's first start (worker/model/cpu_matmul.py; without
# a compiler the worker runs torch's products, slower)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels
USER draftwise
ENV DRAFTWISE_HOST=0.0.0.0 DRAFTWISE_PORT=50061 DRAFTWISE_LOG_FORMAT=json
EXPOSE 50061
CMD ["draftwise", "worker"]
