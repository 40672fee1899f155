#!/usr/bin/env bash
# Call 2, right after callW.sh on the warm machine (~500 s): launch traces of the decode variants
# (TV, 1 round each), 16 sequences at depth 4096 with run-ahead and without (2 rounds), then
# issue 19's table against llama.cpp (pp512, pp8192, tg128 at depth 0 and 32768, one round; 16
# sequences at depth 4096) with TAIL's environment (default none).
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/x; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
TV=${TV:-"ahead:;mr0:EMBER_MOE_ROUTE=0;dn2:EMBER_DELTA_NORM_FUSED=2;off:EMBER_RUN_AHEAD=0;dwide:EMBER_MOE_DOWN_WIDE=1;regw:EMBER_KERNEL_DEFINES=EMBER_ROUTE_REGW"}
OUT=$O ROUNDS=1 VARIANTS="$TV" STAGES=tvariants timeout 130 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
grep -h -E '^\| (moe|route|mailbox|rms_norm|matmul|delta)|launches, [0-9]+ steps' $O/tvariant-*-1.md
echo "traces done at $SECONDS s"
OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128 -d 4096 --n-seq 16' VARIANTS="ahead:;off:EMBER_RUN_AHEAD=0" STAGES=variants \
  timeout 100 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "16 sequences A/B done at $SECONDS s"
T=(${TAIL:-})
env "${T[@]}" OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 70 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
(( SECONDS < L - 45 )) && env "${T[@]}" OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 10 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
(cd ${OUT} && tar czf x.tgz x && rm -rf x)
