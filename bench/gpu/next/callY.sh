#!/usr/bin/env bash
# One call for the whole session when device time is short (~590 s on a fresh machine):
#   * moe_route first (its bits against the three launches; the model's tests through it): off
#     for the rest of the call if either fails;
#   * the GPU test binaries the work since the last GPU run touches (gemv_q8: moe_route;
#     delta_rule: the cluster form; the model's binaries at the defaults: moe_route, run-ahead,
#     attention_wg; attention, wgmma), serve-check, while llama.cpp builds and the 35B is written;
#     model and conformance with the cluster delta norm (EMBER_DELTA_NORM_FUSED=2);
#   * once the build is done: tg128 at the defaults against EMBER_MOE_ROUTE=0, EMBER_DELTA_NORM_FUSED=2
#     and EMBER_RUN_AHEAD=0, two rounds in turn;
#   * issue 19's table against llama.cpp (pp512, pp8192, tg128 at depth 0 and 32768; 16
#     sequences at depth 4096) with the switches that won by more than 1 % (and passed).
set -uo pipefail
L=${LIMIT:-590}
O=${OUT:?}/y; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
tar -C /tmp -xJf .gpu/bin.tar.xz
timeout 60 /tmp/bin/gemv_q8 --test-threads=1 --nocapture moe_route > $O/test-moe-route.log 2>&1; a=$?
timeout 120 /tmp/bin/model --test-threads=1 > $O/test-model-mr.log 2>&1; b=$?
echo "moe_route: test exit $a ($(grep -E 'moe_route|^test result' $O/test-moe-route.log | tr '\n' ' ')), model exit $b at $SECONDS s"
MR_OK=1; if (( a != 0 || b != 0 )); then export EMBER_MOE_ROUTE=0; MR_OK=0; echo "moe_route off for the rest of the call"; fi
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile,model,matmul,mailbox,upload,top_k,transfers STAGES=tests,serve timeout 300 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
DN_OK=1
for t in model conformance; do
  env EMBER_DELTA_NORM_FUSED=2 timeout 90 /tmp/bin/$t --test-threads=1 > $O/test-$t-dn2.log 2>&1; rc=$?
  (( rc == 0 )) || DN_OK=0
  echo "$t (delta_rule_norm_cluster): exit $rc $(grep -E '^test result' $O/test-$t-dn2.log | tail -1)"
done
grep -q 'cluster true): the two launches' $O/test-delta_rule.log || DN_OK=0
echo "cluster delta norm ok: $DN_OK"
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 260 )); do sleep 2; done
echo "llama.cpp: $( [[ -f /tmp/llama/building ]] && echo still building || echo "built (exit $(cat /tmp/llama/built 2>/dev/null))") at $SECONDS s"
V="def:;mr0:EMBER_MOE_ROUTE=0;dn2:EMBER_DELTA_NORM_FUSED=2;ra0:EMBER_RUN_AHEAD=0"
OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128' VARIANTS="$V" STAGES=variants timeout $(( L - 150 - SECONDS > 30 ? L - 150 - SECONDS : 30 )) \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
mean() { python3 -c "import json,glob,sys; v=[x['avg_ts'] for f in glob.glob(sys.argv[1]) for x in json.load(open(f))]; print(sum(v)/len(v) if v else 0)" "$O/variant-$1-*.json" 2>/dev/null || echo 0; }
D=$(mean def); M0=$(mean mr0); D2=$(mean dn2)
echo "tg128 means: defaults $D, EMBER_MOE_ROUTE=0 $M0, EMBER_DELTA_NORM_FUSED=2 $D2"
T=()
python3 -c "import sys; sys.exit(0 if float('$M0') > 1.01 * float('$D') else 1)" && T+=(EMBER_MOE_ROUTE=0)
(( DN_OK == 1 )) && python3 -c "import sys; sys.exit(0 if float('$D2') > 1.01 * float('$D') else 1)" && T+=(EMBER_DELTA_NORM_FUSED=2)
echo "table with: ${T[*]:-defaults}"
env "${T[@]}" OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 45 - SECONDS > 30 ? L - 45 - SECONDS : 30 )) \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
(( SECONDS < L - 35 )) && env "${T[@]}" OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 8 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf y.tgz y && rm -rf y)
