#!/usr/bin/env bash
# ember-cuda on a GPU machine that has no Rust: runs the test binaries built elsewhere.
# Beside this script: `gpu` and `nvrtc_compile`, the stripped binaries of
#   cargo test -p ember-cuda --release --no-run   (tests/gpu.rs, tests/nvrtc_compile.rs).
# Logs go to $OUT (or ./out). Order: environment, NVRTC compile test, GPU tests, matmul
# timings, then the GPU tests again under compute-sanitizer if it is there.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
rc=0
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem --format=csv; ldconfig -p | grep -i nvrtc; } 2>&1 | tee "$OUT/env.log"
./nvrtc_compile --nocapture 2>&1 | tee "$OUT/nvrtc.log" || rc=1
./gpu --test-threads=1 --nocapture 2>&1 | tee "$OUT/gpu-tests.log" || rc=1
./gpu --ignored --nocapture --test-threads=1 bench 2>&1 | tee "$OUT/bench.log" || rc=1
if command -v compute-sanitizer >/dev/null; then
    timeout "${SANITIZER_S:-180}" compute-sanitizer --tool memcheck --print-limit 20 ./gpu --test-threads=1 > "$OUT/sanitizer.log" 2>&1
    echo "compute-sanitizer exit $?: $(grep -E 'ERROR SUMMARY|test result' "$OUT/sanitizer.log" | tr '\n' ' ')"
fi
echo "--- summary"
grep -hE 'test result|MEASURED|max rel err|^bench' "$OUT"/gpu-tests.log "$OUT"/bench.log "$OUT"/nvrtc.log | cut -c1-160
exit $rc
