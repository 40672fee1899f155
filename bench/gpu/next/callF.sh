#!/usr/bin/env bash
# The next session's first call (written 2026-12-06 night, when that session's device time ran
# out before the norm tails ran on a GPU): every GPU test binary and serve-check at the tree
# (LLAMA=1 builds llama.cpp meanwhile), and beside them gpu / conformance / model / graph /
# hybrid with EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1 (one-token output projections and the MoE end
# their launch with the next norm: NormTail in kernels/q8.cuh; the router's GEMV ends with the
# routing: RouteTail in kernels/matmul.cu; gemv_q8's norm_tails and gpu's route_tail tests call
# them directly); serve-check with them; decode tg128 with neither, each and both, three rounds
# alternating; then issue 19's table against llama.cpp (TAIL: the environment of the winner,
# default both) and batched decode as time allows.
# Run from the repo root with .gpu carried (bench/gpu/pack.sh); LIMIT = the call's limit_s.
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/f; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
( for t in gpu conformance model graph hybrid; do
    EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1 timeout 200 /tmp/bin/$t --test-threads=1 > $O/test-tail-$t.log 2>&1 &
  done; wait ) &
SW=$!
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
wait $SW
for f in $O/test-tail-*.log; do echo "$(basename $f): $(grep -E '^test result' $f | tail -1)"; done
grep -h "norm tails:" $O/test-gemv_q8.log
EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1 timeout 100 python3 bench/gpu/serve-check.py /tmp/bin/ember > $O/serve-check-tail.log 2>&1; echo "serve-check (tails): exit $?"
OUT=$O VARIANTS='base:;norm:EMBER_NORM_TAIL=1;route:EMBER_ROUTE_TAIL=1;both:EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1' VARIANT_ARGS='-p 0 -n 128' ROUNDS=3 STAGES=variants \
  timeout $(( L - 200 - SECONDS > 30 ? L - 200 - SECONDS : 30 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "decode variants done at $SECONDS s"
# The table with the tails on (set by environment; made the default afterwards if they won).
T=(${TAIL:-EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1})
if (( SECONDS < L - 100 )); then
  env "${T[@]}" OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 40 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "bench done at $SECONDS s"
fi
(( SECONDS < L - 45 )) && env "${T[@]}" OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 15 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "batched done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf f.tgz f && rm -rf f)
