#!/usr/bin/env bash
# Call M, at 5667991: every GPU test binary and serve-check (llama.cpp building, the 35B being
# written), with the test binaries that cover them also under each off switch (EMBER_ATM_LEAN:
# attention_mma's leaner staging/softmax; EMBER_Q4K_L4: Q4_K's int8 unit on 4 lanes); the
# prompt attention microbenchmark with and without EMBER_ATM_LEAN; e2e ember under default /
# lean / l4 (pp512, tg128 at depth 0 and 32768, two rounds); issue 19's table vs llama.cpp.
set -uo pipefail
O=${OUT:?}/m; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
( for sw in EMBER_ATM_LEAN EMBER_Q4K_L4; do for t in attention conformance model gemv_q8 gpu; do
    EMBER_KERNEL_CACHE=/tmp/kc-$sw EMBER_KERNEL_DEFINES=$sw timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-$sw-$t.log 2>&1 &
  done; done; wait ) &
SW=$!
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
wait $SW
for f in $O/test-EMBER_*.log; do echo "$(basename $f): $(grep -E '^test result' $f | tail -1)"; done
echo "switch tests done at $SECONDS s"
for sw in "" EMBER_ATM_LEAN; do
  EMBER_KERNEL_DEFINES=$sw timeout 60 /tmp/bin/attention --ignored --test-threads=1 --nocapture bench_attention_mma > $O/micro-atm-${sw:-base}.log 2>&1
  echo "micro ${sw:-base}: exit $?"; grep -iE 'mma|TFLOP|us' $O/micro-atm-${sw:-base}.log | head -8
done
echo "micro done at $SECONDS s"
R=2; (( SECONDS > 260 )) && R=1
OUT=$O VARIANTS='base:;lean:EMBER_KERNEL_DEFINES=EMBER_ATM_LEAN;l4:EMBER_KERNEL_DEFINES=EMBER_Q4K_L4' VARIANT_ARGS='-p 512 -n 128 -d 0,32768' ROUNDS=$R STAGES=variants timeout $(( 440 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( 575 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf m.tgz m && rm -rf m)
