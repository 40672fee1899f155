#!/usr/bin/env bash
set -uo pipefail
O=${OUT:?}; mkdir -p $O/k
OUT=$O/k LLAMA=0 STAGES=variants ROUNDS=2 VARIANT_ARGS='-p 512,2048 -n 128' \
  VARIANTS='plain:;norm:EMBER_KERNEL_DEFINES=EMBER_NORM_W_EARLY;normdown:EMBER_KERNEL_DEFINES=EMBER_NORM_W_EARLY,EMBER_MOE_DOWN_W_EARLY' ./bench/gpu/h200.sh
echo "variants done at $SECONDS s"
OUT=$O/k LLAMA=0 STAGES=cpuab ROUNDS=2 CPU_AB=EMBER_CPU_PAR_ZEROS=1 ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && tar czf k.tgz k && rm -rf k)
