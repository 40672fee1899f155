#!/usr/bin/env bash
# The next session's first call (written 2026-12-06 evening, after calls q-x): every GPU test
# binary and serve-check at the final tree (the MoE grouped from 5 tokens is the default now;
# the calls before ran it by environment), attention / conformance / model again with
# EMBER_ATTN_MMA_WIDE=1 (attention_mma_w8: 128 query vectors a block), bench_attention_mma with
# and without it, prompts at depth 0 and 32768 with and without it; EMBER_Q8_REDUX (warp_q8 by
# redux.sync) under gemv_q8 / gpu / conformance / model and tg128 with it; then issue 19's table and
# batched decode against llama.cpp if time is left. Run from the repo root with .gpu carried
# (bench/gpu/pack.sh); LIMIT = the call's limit_s when below 600.
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/a; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
( for t in attention conformance model; do
    EMBER_ATTN_MMA_WIDE=1 timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-wide-$t.log 2>&1 &
  done
  for t in gemv_q8 gpu conformance model; do
    EMBER_KERNEL_CACHE=/tmp/kc-q8r EMBER_KERNEL_DEFINES=EMBER_Q8_REDUX timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-q8redux-$t.log 2>&1 &
  done; wait ) &
SW=$!
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
wait $SW
for f in $O/test-wide-*.log $O/test-q8redux-*.log; do echo "$(basename $f): $(grep -E '^test result' $f | tail -1)"; done
for w in 0 1; do
  EMBER_ATTN_MMA_WIDE=$w timeout 60 /tmp/bin/attention --ignored --test-threads=1 --nocapture --exact bench_attention_mma > "$O/micro-atm-wide$w.log" 2>&1
  echo "micro wide=$w: $(grep -E 'depth' "$O/micro-atm-wide$w.log" | tr '\n' ' ')"
done
echo "micro done at $SECONDS s"
(( SECONDS < L - 200 )) && OUT=$O VARIANTS='base:;wide:EMBER_ATTN_MMA_WIDE=1' VARIANT_ARGS='-p 512,8192 -n 0 -d 0,32768' ROUNDS=2 STAGES=variants \
  timeout $(( L - 200 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
(( SECONDS < L - 150 )) && OUT=$O VARIANTS='dbase:;q8redux:EMBER_KERNEL_DEFINES=EMBER_Q8_REDUX' VARIANT_ARGS='-p 0 -n 128' ROUNDS=3 STAGES=variants \
  timeout $(( L - 110 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "decode variants done at $SECONDS s"
if (( SECONDS < L - 120 )); then
  OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 60 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "bench done at $SECONDS s"
fi
(( SECONDS < L - 50 )) && OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 15 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "batched done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf a.tgz a && rm -rf a)
