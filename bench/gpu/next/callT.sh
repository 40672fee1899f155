#!/usr/bin/env bash
# One call when the session's device time allows only one (~570 s on a fresh machine): the GPU
# tests the work since the last run touches (run-ahead: ahead, model, hybrid, split, graph, gpu,
# transfers, references, conformance; wgmma; attention with attention_wg's test) and serve-check
# at the defaults (decode steps run ahead), llama.cpp building and the 35B written beside; then
# which way the GPU reads V's descriptor (tests/wgmma.rs), attention_wg's tests against
# attention_mma_w8 and the reference at the wide tiles and bench_attention_mma with it and
# without; then issue 19's table against llama.cpp (pp8192 and tg128 at depth 0 and 32768, one
# round; attention_wg, the default, off where it failed its tests); then tg128 run-ahead against
# EMBER_RUN_AHEAD=0 if time is left.
set -uo pipefail
L=${LIMIT:-570}
O=${OUT:?}/t; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile,gemv_q8,matmul,delta_rule,mailbox,upload,top_k STAGES=tests,serve timeout 250 \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
echo "wgmma: $(grep -E '^V offsets|^test result' $O/test-wgmma.log 2>/dev/null | tr '\n' ' ')"
env EMBER_ATTN_WG=1 EMBER_ATTN_MMA_WIDE=1 timeout 100 /tmp/bin/attention --test-threads=1 --nocapture tile > $O/test-attn-wg.log 2>&1
WG_RC=$?
echo "attention tiles (wg, wide): exit $WG_RC $(grep -E '^test result|tiles vs reference|against attention_mma_w8' $O/test-attn-wg.log | tr '\n' ' ')"
for v in wg plain; do
  e=(); [[ $v == plain ]] && e+=(EMBER_ATTN_WG=0)
  env "${e[@]}" timeout 45 /tmp/bin/attention --test-threads=1 --nocapture --ignored bench_attention_mma > $O/bench-attn-$v.log 2>&1
  echo "bench_attention_mma $v: exit $?"; grep '^bench' $O/bench-attn-$v.log
done
echo "attention done at $SECONDS s"
T=(); [[ $WG_RC == 0 ]] || T+=(EMBER_ATTN_WG=0)
echo "table with: ${T[*]:-defaults}"
(( SECONDS < L - 120 )) && env "${T[@]}" OUT=$O ROUNDS=1 PROMPTS=8192 DEPTHS=32768 STAGES=bench timeout $(( L - 15 - SECONDS )) \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "table done at $SECONDS s"
if (( SECONDS < L - 70 )); then
  OUT=$O ROUNDS=1 VARIANT_ARGS='-p 0 -n 128' VARIANTS="ahead:;off:EMBER_RUN_AHEAD=0" STAGES=variants timeout $(( L - 10 - SECONDS )) \
    ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
fi
echo "done at $SECONDS s"
(cd ${OUT} && tar czf t.tgz t && rm -rf t)
