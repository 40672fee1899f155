#!/usr/bin/env bash
# Two switches built 2026-12-07 after g30, never run, ~200 s on a warm machine that has the 35B
# and the binaries (after callP.sh): the Q6_K MoE down at 4 lanes a unit (EMBER_MOE_DOWN_WIDE=1:
# the MoE test, model and references with it) and the route's weights kept in registers
# (EMBER_KERNEL_DEFINES=EMBER_ROUTE_REGW: route_matches_reference, model); tg128 against the
# defaults (VROUNDS rounds in turn, default 3), and launch traces of all three in turn (h200.sh
# tvariants, TROUNDS rounds: the GPU chain; the down is `moe 1024x1`, 6.15-6.35 us a layer in
# g30, the route `route 1x1`, 3.8-4.1).
set -uo pipefail
O=${OUT:?}/d; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
W=EMBER_MOE_DOWN_WIDE=1
env $W timeout 90 /tmp/bin/gemv_q8 --test-threads=1 --exact moe_q8_matches_quantised_reference > $O/test-moe-dwide.log 2>&1
echo "moe test: $(grep -E '^test result' $O/test-moe-dwide.log)"
for t in model references; do
  env $W timeout 60 /tmp/bin/$t --test-threads=1 > $O/test-$t-dwide.log 2>&1
  echo "$t: $(grep -E '^test result' $O/test-$t-dwide.log | tail -1)"
done
R=EMBER_KERNEL_DEFINES=EMBER_ROUTE_REGW
env $R timeout 60 /tmp/bin/gpu --test-threads=1 --exact route_matches_reference > $O/test-route-regw.log 2>&1
echo "route test (regw): $(grep -E '^test result' $O/test-route-regw.log)"
env $R timeout 60 /tmp/bin/model --test-threads=1 > $O/test-model-regw.log 2>&1
echo "model (regw): $(grep -E '^test result' $O/test-model-regw.log | tail -1)"
OUT=$O ROUNDS=${VROUNDS:-3} VARIANT_ARGS='-p 0 -n 128' VARIANTS="two:;dwide:$W;regw:$R" STAGES=variants \
  timeout 100 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
# (first128: the step's first graph at 128 launches, so 3 graphs a step, not 4: whether a
# graph boundary, where no programmatic edge links the lists, costs the chain a few us.)
OUT=$O ROUNDS=${TROUNDS:-3} VARIANTS="two:;dwide:$W;regw:$R;first128:EMBER_CUDA_GRAPH_FIRST=128" STAGES=tvariants timeout 200 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
grep -h -E '^\| (moe|route)' $O/tvariant-*-1.md
echo "done at $SECONDS s"
(cd ${OUT} && tar czf d.tgz d && rm -rf d)
