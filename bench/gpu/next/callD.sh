#!/usr/bin/env bash
# The Q6_K MoE down at 4 lanes a unit (EMBER_MOE_DOWN_WIDE=1, built 2026-12-07 after g30, never
# run), ~150 s on a warm machine that has the 35B and the binaries (after callP.sh): the MoE
# test, model and references with it, tg128 against the defaults (VROUNDS rounds in turn,
# default 3), and the two launch traces (the down is `moe 1024x1`: 6.15-6.35 us a layer in g30).
set -uo pipefail
O=${OUT:?}/d; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember; F=/tmp/m/35b.gguf; W=EMBER_MOE_DOWN_WIDE=1
env $W timeout 90 /tmp/bin/gemv_q8 --test-threads=1 --exact moe_q8_matches_quantised_reference > $O/test-moe-dwide.log 2>&1
echo "moe test: $(grep -E '^test result' $O/test-moe-dwide.log)"
for t in model references; do
  env $W timeout 60 /tmp/bin/$t --test-threads=1 > $O/test-$t-dwide.log 2>&1
  echo "$t: $(grep -E '^test result' $O/test-$t-dwide.log | tail -1)"
done
OUT=$O ROUNDS=${VROUNDS:-3} VARIANT_ARGS='-p 0 -n 128' VARIANTS="two:;dwide:$W" STAGES=variants \
  timeout 100 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
for v in two: dwide:$W; do
  n=${v%%:*}
  env ${v#*:} EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-$n.txt timeout 60 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-$n.json 2> $O/tr-$n.log
  python3 bench/gpu/trace.py $O/tr-$n.txt > $O/tr-$n.md 2>&1
  echo "trace $n: $(head -1 $O/tr-$n.md | grep -o 'median step [0-9.]* us')"; grep -E '^\| moe' $O/tr-$n.md
done
xz -T8 $O/*.txt 2>/dev/null
echo "done at $SECONDS s"
(cd ${OUT} && tar czf d.tgz d && rm -rf d)
