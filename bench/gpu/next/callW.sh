#!/usr/bin/env bash
# 2026-12-07 session, call 1 (~580 s on a fresh machine): every GPU test binary and serve-check
# at the tree's defaults (attention_wg and run-ahead on, the tile helpers shared), while
# llama.cpp builds and the 35B is written (moe_route, the MoE prelude in one cluster launch, on by
# default: gemv_q8's moe_route_matches_its_three_launches, and every model test through it); attention_wg below 4,096 keys (EMBER_ATTN_MMA_WIDE=1)
# tested and timed while the build finishes; then, on a quiet host, tg128 with run-ahead against
# EMBER_MOE_ROUTE=0 (the three launches), EMBER_RUN_AHEAD=0 and a step in one graph, and callD's two switches (the wide Q6_K down, the
# route's register weights: their tests first), 3 rounds in turn.
set -uo pipefail
L=${LIMIT:-580}
O=${OUT:?}/w; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
tar -C /tmp -xJf .gpu/bin.tar.xz
# moe_route first: its bits against the three launches, and the model's tests through it; if
# either fails, the rest of the call runs without it.
timeout 60 /tmp/bin/gemv_q8 --test-threads=1 --nocapture moe_route > $O/test-moe-route.log 2>&1; a=$?
timeout 120 /tmp/bin/model --test-threads=1 > $O/test-model-mr.log 2>&1; b=$?
echo "moe_route: test exit $a ($(grep -E 'moe_route|^test result' $O/test-moe-route.log | tr '\n' ' ')), model exit $b at $SECONDS s"
if (( a != 0 || b != 0 )); then export EMBER_MOE_ROUTE=0; echo "moe_route off for the rest of the call"; fi
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve timeout 330 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
env EMBER_ATTN_MMA_WIDE=1 timeout 100 /tmp/bin/attention --test-threads=1 --nocapture tile > $O/test-attn-wide.log 2>&1
echo "attention tiles (wide everywhere): exit $? $(grep -E '^test result' $O/test-attn-wide.log | tr '\n' ' ')"
OUT=$O ROUNDS=1 VARIANT_ARGS='-p 512,2048,8192 -n 0' VARIANTS="default:;wide:EMBER_ATTN_MMA_WIDE=1" STAGES=variants timeout 90 \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
for t in model conformance; do
  env EMBER_DELTA_NORM_FUSED=2 timeout 90 /tmp/bin/$t --test-threads=1 > $O/test-$t-dn2.log 2>&1
  echo "$t (delta_rule_norm_cluster): exit $? $(grep -E '^test result' $O/test-$t-dn2.log | tail -1)"
done
W=EMBER_MOE_DOWN_WIDE=1; R=EMBER_KERNEL_DEFINES=EMBER_ROUTE_REGW
env $W timeout 90 /tmp/bin/gemv_q8 --test-threads=1 --exact moe_q8_matches_quantised_reference > $O/test-moe-dwide.log 2>&1
echo "moe test (dwide): $(grep -E '^test result' $O/test-moe-dwide.log)"
env $W timeout 60 /tmp/bin/model --test-threads=1 > $O/test-model-dwide.log 2>&1
echo "model (dwide): $(grep -E '^test result' $O/test-model-dwide.log | tail -1)"
env $R timeout 60 /tmp/bin/gpu --test-threads=1 --exact route_matches_reference > $O/test-route-regw.log 2>&1
echo "route test (regw): $(grep -E '^test result' $O/test-route-regw.log)"
env $R timeout 60 /tmp/bin/model --test-threads=1 > $O/test-model-regw.log 2>&1
echo "model (regw): $(grep -E '^test result' $O/test-model-regw.log | tail -1)"
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 200 )); do sleep 2; done
echo "llama.cpp: $( [[ -f /tmp/llama/building ]] && echo still building || echo "built (exit $(cat /tmp/llama/built 2>/dev/null))") at $SECONDS s"
V="ahead:;mr0:EMBER_MOE_ROUTE=0;dn2:EMBER_DELTA_NORM_FUSED=2;off:EMBER_RUN_AHEAD=0;dwide:$W;regw:$R"
OUT=$O ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' VARIANTS="$V" STAGES=variants timeout $(( L - 10 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf w.tgz w && rm -rf w)
