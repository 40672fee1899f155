#!/usr/bin/env bash
# Call J: the three kernel switches A/B on decode (tg128 at depth 0 and 32768, 3 rounds), then the
# skip diagnostic with what time is left.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/j
OUT=$O/j LLAMA=0 STAGES=variants,skip ROUNDS=3 SKIP_BY=540 VARIANT_ARGS='-p 0 -n 128 -d 0,32768' \
  VARIANTS='plain:;norm:EMBER_KERNEL_DEFINES=EMBER_NORM_W_EARLY;gemv:EMBER_KERNEL_DEFINES=EMBER_GEMV_W_EARLY;down:EMBER_KERNEL_DEFINES=EMBER_MOE_DOWN_W_EARLY;all:EMBER_KERNEL_DEFINES=EMBER_NORM_W_EARLY,EMBER_GEMV_W_EARLY,EMBER_MOE_DOWN_W_EARLY' \
  ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && tar czf j.tgz j && rm -rf j)
