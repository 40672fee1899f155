#!/usr/bin/env bash
# This session's first call (2026-12-06 night): every GPU test binary and serve-check at the
# tree packed (LLAMA=1 builds llama.cpp meanwhile); beside them the switches' tests: attention /
# conformance / model with EMBER_ATTN_MMA_WIDE=1 (attention_mma_w8), and gemv_q8 / gpu /
# conformance / model / hybrid under EMBER_Q8_REDUX, EMBER_Q8_BATCH, EMBER_Q8_BATCH4 and
# EMBER_K4_SEL; then bench_attention_mma wide 0/1; decode tg128 under each decode switch (3
# rounds, alternating); prompts at depth 0 and 32768 with and without the wide tiles (2 rounds).
# Run from the repo root with .gpu carried (bench/gpu/pack.sh); LIMIT = the call's limit_s.
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/b; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
( for t in attention conformance model; do
    EMBER_ATTN_MMA_WIDE=1 timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-wide-$t.log 2>&1 &
  done; wait
  for sw in EMBER_Q8_BATCH EMBER_Q8_BATCH4 EMBER_K4_SEL,EMBER_Q8_REDUX; do
    for t in gemv_q8 gpu conformance model hybrid; do
      [[ $t == gemv_q8 && $sw != EMBER_K4_SEL* ]] && continue  # gemv_q8's kernels: no EMBER_Q8_BATCH
      EMBER_KERNEL_CACHE=/tmp/kc-${sw/,/-} EMBER_KERNEL_DEFINES=$sw timeout 200 /tmp/bin/$t --test-threads=1 > $O/test-${sw/,/-}-$t.log 2>&1 &
    done; wait
  done ) &
SW=$!
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
wait $SW
echo "switch tests done at $SECONDS s"
for f in $O/test-wide-*.log $O/test-EMBER_*.log; do echo "$(basename $f): $(grep -E '^test result' $f | tail -1)"; done
(( SECONDS < L - 120 )) && OUT=$O VARIANTS='dbase:;batch:EMBER_KERNEL_DEFINES=EMBER_Q8_BATCH;batch4:EMBER_KERNEL_DEFINES=EMBER_Q8_BATCH4;k4sel:EMBER_KERNEL_DEFINES=EMBER_K4_SEL;b4k4:EMBER_KERNEL_DEFINES=EMBER_Q8_BATCH4,EMBER_K4_SEL;q8redux:EMBER_KERNEL_DEFINES=EMBER_Q8_REDUX' VARIANT_ARGS='-p 0 -n 128' ROUNDS=3 STAGES=variants \
  timeout $(( L - 80 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "decode variants done at $SECONDS s"
for w in 0 1; do
  (( SECONDS < L - 60 )) || break
  EMBER_ATTN_MMA_WIDE=$w timeout 40 /tmp/bin/attention --ignored --test-threads=1 --nocapture --exact bench_attention_mma > "$O/micro-atm-wide$w.log" 2>&1
  echo "micro wide=$w: $(grep -E 'depth' "$O/micro-atm-wide$w.log" | tr '\n' ' ')"
done
(( SECONDS < L - 80 )) && OUT=$O VARIANTS='base:;wide:EMBER_ATTN_MMA_WIDE=1' VARIANT_ARGS='-p 512,8192 -n 0 -d 0,32768' ROUNDS=2 STAGES=variants \
  timeout $(( L - 20 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "prompt variants done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf b.tgz b && rm -rf b)
