#!/usr/bin/env bash
# CudaOps on a GPU machine that has no Rust: runs test binaries built elsewhere, from the
# repository root (the model test reads tests/fixtures/ from there).
# Beside this script (in .gpu/): `conformance`, `model`, `gpu`, `nvrtc_compile`, the stripped
# binaries of `cargo test -p ember-cuda --release --no-run`. Logs go to $OUT (or ./out).
# Order: environment, NVRTC compile test, the kernel tests, the conformance suite, the model
# test, the attention timings, then the conformance suite under compute-sanitizer memcheck if
# it is there.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export EMBER_KERNEL_CACHE=${EMBER_KERNEL_CACHE:-/tmp/ember-kernels}
rc=0
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,memory.used --format=csv; } 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
[ -x "$here/nvrtc_compile" ] && { "$here/nvrtc_compile" 2>&1 | tail -3 | tee "$OUT/nvrtc.log" || rc=1; }
[ -x "$here/gpu" ] && { "$here/gpu" --test-threads=1 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "test result|FAILED|panicked" || rc=1; }
echo "--- kernel tests done in $(( $(date +%s) - t0 )) s"
"$here/conformance" --nocapture --test-threads=1 2>&1 | tee "$OUT/conformance.log" || rc=1
echo "--- conformance done in $(( $(date +%s) - t0 )) s"
"$here/model" --nocapture 2>&1 | tee "$OUT/model.log" || rc=1
echo "--- model done in $(( $(date +%s) - t0 )) s"
"$here/conformance" --ignored --nocapture bench 2>&1 | tee "$OUT/bench.log" | grep -E "^bench|panicked" || rc=1
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
    timeout "${SANITIZER_S:-200}" compute-sanitizer --tool memcheck --print-limit 20 "$here/conformance" cuda_ops_conform > "$OUT/sanitizer.log" 2>&1
    echo "compute-sanitizer (conformance) exit $?: $(grep -E 'ERROR SUMMARY|test result' "$OUT/sanitizer.log" | tr '\n' ' ')"
    timeout "${SANITIZER_S:-200}" compute-sanitizer --tool memcheck --print-limit 20 "$here/model" batched > "$OUT/sanitizer-model.log" 2>&1
    echo "compute-sanitizer (model, batched) exit $?: $(grep -E 'ERROR SUMMARY|test result' "$OUT/sanitizer-model.log" | tr '\n' ' ')"
    cat "$OUT/sanitizer-model.log" >> "$OUT/sanitizer.log" && rm "$OUT/sanitizer-model.log"
    grep -m 20 -E "Invalid|Error|error" "$OUT/sanitizer.log" | head -20
fi
echo "--- summary ($(( $(date +%s) - t0 )) s)"
grep -hE 'test result|panicked|skipped' "$OUT"/*.log | cut -c1-200
exit $rc
