#!/usr/bin/env bash
# The 2026-12-08 session's one call, cut to ~430 s (the device time left after refused starts): moe_route's test and
# the model's through it first; the touched test binaries (delta_rule with the cluster form,
# gemv_q8, conformance, hybrid, ahead, attention, graph, split) and serve-check while llama.cpp
# builds and the 35B is written; tg128 at the defaults against EMBER_MOE_ROUTE=0 and
# EMBER_DELTA_NORM_FUSED=2 (two rounds in turn); issue 19's table against llama.cpp with the
# winners; 16 sequences if time is left.
set -uo pipefail
L=${LIMIT:-430}
O=${OUT:?}/z; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
tar -C /tmp -xJf .gpu/bin.tar.xz
timeout 60 /tmp/bin/gemv_q8 --test-threads=1 --nocapture moe_route > $O/test-moe-route.log 2>&1; a=$?
timeout 120 /tmp/bin/model --test-threads=1 > $O/test-model-mr.log 2>&1; b=$?
echo "moe_route: test exit $a ($(grep -E 'moe_route|^test result' $O/test-moe-route.log | tr '\n' ' ')), model exit $b at $SECONDS s"
if (( a != 0 || b != 0 )); then export EMBER_MOE_ROUTE=0; echo "moe_route off for the rest of the call"; fi
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile,model,matmul,mailbox,upload,top_k,transfers,wgmma,references,gpu STAGES=tests timeout 170 \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests done at $SECONDS s"
DN_OK=0; grep -q 'cluster true): the two launches' $O/test-delta_rule.log && DN_OK=1
echo "cluster delta norm test passed: $DN_OK"
OUT=$O STAGES=serve timeout 90 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "serve done at $SECONDS s"
V="def:;mr0:EMBER_MOE_ROUTE=0"; (( DN_OK == 1 )) && V="$V;dn2:EMBER_DELTA_NORM_FUSED=2"
OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128' VARIANTS="$V" STAGES=variants timeout 100 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
mean() { python3 -c "import json,glob,sys; v=[x['avg_ts'] for f in glob.glob(sys.argv[1]) for x in json.load(open(f))]; print(sum(v)/len(v) if v else 0)" "$O/variant-$1-*.json" 2>/dev/null || echo 0; }
D=$(mean def); M0=$(mean mr0); D2=$(mean dn2)
echo "tg128 means: defaults $D, EMBER_MOE_ROUTE=0 $M0, EMBER_DELTA_NORM_FUSED=2 $D2"
T=()
python3 -c "import sys; sys.exit(0 if float('$M0') > 1.01 * float('$D') else 1)" && T+=(EMBER_MOE_ROUTE=0)
python3 -c "import sys; sys.exit(0 if float('$D2') > 1.01 * float('$D') else 1)" && T+=(EMBER_DELTA_NORM_FUSED=2)
echo "table with: ${T[*]:-defaults}"
(( SECONDS < L - 60 )) && env "${T[@]}" OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 30 - SECONDS )) \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
(( SECONDS < L - 35 )) && env "${T[@]}" OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 8 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf z.tgz z && rm -rf z)
