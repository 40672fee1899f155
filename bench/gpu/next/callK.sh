#!/usr/bin/env bash
# The one-token MoE's launch shapes (~150 s on a warm machine that has the 35B, e.g. after
# callP.sh): gemv_q8's MoE test under EMBER_MOE_GU_SEG=32 (gate/up at 32 lanes a row, 1,024
# threads a block) and EMBER_MOE_DOWN_WR=4 / 16 (down's workers a row; 8 by default on the 35B),
# then tg128 under each, ROUNDS rounds in turn, and the launch trace of the best-looking one.
set -uo pipefail
L=${LIMIT:-300}
O=${OUT:?}/k; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
for v in "EMBER_MOE_GU_SEG=32" "EMBER_MOE_DOWN_WR=4" "EMBER_MOE_DOWN_WR=16"; do
  env $v timeout 200 /tmp/bin/gemv_q8 --test-threads=1 --exact moe_q8_matches_quantised_reference > "$O/test-${v#EMBER_}.log" 2>&1
  echo "$v: $(grep -E '^test result' "$O/test-${v#EMBER_}.log")"
done
OUT=$O ROUNDS=${ROUNDS:-2} VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS='base:;gu32:EMBER_MOE_GU_SEG=32;dwr4:EMBER_MOE_DOWN_WR=4;dwr16:EMBER_MOE_DOWN_WR=16' STAGES=variants \
  timeout $(( L - 60 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
T=(EMBER_KERNEL_DEFINES=EMBER_TRACE)
for v in base: gu32:EMBER_MOE_GU_SEG=32; do
  (( SECONDS < L - 30 )) || break
  n=${v%%:*}; envs=(${v#*:})
  env "${T[@]}" "${envs[@]}" EMBER_CUDA_TRACE=$O/tr-$n.txt timeout 60 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-$n.json 2> $O/tr-$n.log
  python3 bench/gpu/trace.py $O/tr-$n.txt > $O/tr-$n.md 2>&1; echo "trace $n:"; sed -n 1,8p $O/tr-$n.md
done
xz -T4 $O/tr-*.txt 2>/dev/null
echo "done at $SECONDS s"
(cd ${OUT} && tar czf k.tgz k && rm -rf k)
