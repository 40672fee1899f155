#!/usr/bin/env bash
# CudaOps on a GPU machine that has no Rust: runs test binaries built elsewhere, from the
# repository root (the model test reads tests/fixtures/ from there).
# Beside this script (in .gpu/): `conformance`, `model`, `gpu`, `nvrtc_compile`, the stripped
# binaries of `cargo test -p ember-cuda --release --no-run`. Logs go to $OUT (or ./out).
# Order: environment, NVRTC compile test, the kernel tests, the conformance suite, the model
# test, then the conformance suite under compute-sanitizer memcheck if it is there.
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
"$here/conformance" --nocapture 2>&1 | tee "$OUT/conformance.log" || rc=1
echo "--- conformance done in $(( $(date +%s) - t0 )) s"
"$here/model" --nocapture 2>&1 | tee "$OUT/model.log" || rc=1
echo "--- model done in $(( $(date +%s) - t0 )) s"
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
    timeout "${SANITIZER_S:-200}" compute-sanitizer --tool memcheck --print-limit 20 "$here/conformance" > "$OUT/sanitizer.log" 2>&1
    echo "compute-sanitizer exit $?: $(grep -E 'ERROR SUMMARY|test result' "$OUT/sanitizer.log" | tr '\n' ' ')"
    grep -m 20 -E "Invalid|Error|error" "$OUT/sanitizer.log" | head -20
fi
echo "--- summary ($(( $(date +%s) - t0 )) s)"
grep -hE 'test result|panicked|skipped' "$OUT"/*.log | cut -c1-200
exit $rc
