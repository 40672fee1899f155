#!/usr/bin/env bash
# The next session's first call, written at the end of 2026-12-06's (whose device time was
# spent): every GPU test binary and serve-check at the final tree (llama.cpp building, the 35B
# being written); the tests that cover each off switch with it on (EMBER_ATM_PIPE,
# EMBER_ATM_STAGE and EMBER_ATM_LDSM: attention, conformance, model; EMBER_MMA8_LOADS: gpu, matmul, conformance,
# model; EMBER_ROUTE_REDUX: gpu, model); bench_attention_mma with each attention switch; ember's prompt variants (base, pipe,
# stage, both, loads) at pp512 / pp8192 and pp512 at depth 32768; issue 19's table against
# llama.cpp at the defaults. Run from the repo root with .gpu carried (bench/gpu/pack.sh).
set -uo pipefail
L=${LIMIT:-600}  # the call's limit (run's limit_s: less where less device time is left)
O=${OUT:?}/q; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
( for sw in EMBER_ATM_PIPE EMBER_ATM_STAGE EMBER_ATM_LDSM; do for t in attention conformance model; do
    EMBER_KERNEL_CACHE=/tmp/kc-$sw EMBER_KERNEL_DEFINES=$sw timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-$sw-$t.log 2>&1 &
  done; done
  for t in gpu matmul conformance model; do
    EMBER_KERNEL_CACHE=/tmp/kc-loads EMBER_KERNEL_DEFINES=EMBER_MMA8_LOADS timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-EMBER_MMA8_LOADS-$t.log 2>&1 &
  done
  for t in gpu model; do
    EMBER_KERNEL_CACHE=/tmp/kc-route EMBER_KERNEL_DEFINES=EMBER_ROUTE_REDUX timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-EMBER_ROUTE_REDUX-$t.log 2>&1 &
  done; wait ) &
SW=$!
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
wait $SW
for f in $O/test-EMBER_*.log; do echo "$(basename $f): $(grep -E '^test result' $f | tail -1)"; done
(( SECONDS < L - 260 )) && for sw in "" EMBER_ATM_PIPE EMBER_ATM_STAGE EMBER_ATM_PIPE,EMBER_ATM_STAGE EMBER_ATM_LDSM EMBER_ATM_LDSM,EMBER_ATM_PIPE EMBER_ATM_LDSM,EMBER_ATM_PIPE,EMBER_ATM_STAGE; do
  EMBER_KERNEL_DEFINES=$sw timeout 60 /tmp/bin/attention --ignored --test-threads=1 --nocapture --exact bench_attention_mma > "$O/micro-atm-${sw:-base}.log" 2>&1
  echo "micro ${sw:-base}: $(grep -E 'depth 32768' "$O/micro-atm-${sw:-base}.log")"
done
for sw in "" EMBER_ROUTE_REDUX; do
  EMBER_KERNEL_DEFINES=$sw timeout 60 /tmp/bin/gpu --ignored --test-threads=1 --nocapture --exact bench_ops > "$O/micro-ops-${sw:-base}.log" 2>&1
  echo "ops ${sw:-base}: $(grep -E 'route' "$O/micro-ops-${sw:-base}.log")"
done
echo "micro done at $SECONDS s"
R=1; (( SECONDS < 200 && L >= 600 )) && R=2  # ~25 s a variant run (depth 32768 prefilled twice)
OUT=$O VARIANTS='base:;pipe:EMBER_KERNEL_DEFINES=EMBER_ATM_PIPE;stage:EMBER_KERNEL_DEFINES=EMBER_ATM_STAGE;both:EMBER_KERNEL_DEFINES=EMBER_ATM_PIPE,EMBER_ATM_STAGE;loads:EMBER_KERNEL_DEFINES=EMBER_MMA8_LOADS' \
  VARIANT_ARGS='-p 512,8192 -n 0 -d 0,32768' ROUNDS=$R STAGES=variants timeout $(( L - 120 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 20 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf q.tgz q && rm -rf q)
