#!/usr/bin/env bash
# Right after callR.sh on the warm machine (~560 s), the host quiet (llama.cpp built there):
#   * run-ahead against EMBER_RUN_AHEAD=0, and run-ahead with a step in one graph
#     (EMBER_AHEAD_FIRST=512: a step queued ahead has no reason to send its first launches
#     early, and the 3-4 boundaries between a step's graphs have no programmatic edge): tg128 (3
#     rounds in turn), the launch traces (1 round: the median step; with run-ahead the host's
#     time between steps is `feed_wait`'s, module mailbox 1x1, the step's last launch in
#     trace.py's cut), 16 sequences at depth 4096 (2 rounds);
#   * through HTTP (`ember serve` + `bench-http`, depth 512) against in-process, both ways;
#   * callD.sh (the wide Q6_K down, the route's register weights) if time is left.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/s; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
V="ahead:;off:EMBER_RUN_AHEAD=0;one:EMBER_AHEAD_FIRST=512"
OUT=$O ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' VARIANTS="$V" STAGES=variants timeout 150 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tg128 A/B done at $SECONDS s"
OUT=$O ROUNDS=1 VARIANTS="$V" STAGES=tvariants timeout 150 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
grep -h -E '^\| (mailbox|top_k|get_rows)|launches, [0-9]+ steps' $O/tvariant-*-1.md
echo "traces done at $SECONDS s"
OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128 -d 4096 --n-seq 16' VARIANTS="ahead:;off:EMBER_RUN_AHEAD=0" STAGES=variants \
  timeout 120 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "16 sequences A/B done at $SECONDS s"
# Through HTTP (issue 19: within 5 % of in-process), run-ahead and not.
(( SECONDS < L - 150 )) && OUT=$O ROUNDS=1 HTTP_RUNS=2 HTTP_AB="ahead:;off:EMBER_RUN_AHEAD=0" STAGES=ghttp timeout $(( L - 30 - SECONDS )) \
  ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "http done at $SECONDS s"
(( SECONDS < L - 200 )) && OUT=$O bash bench/gpu/next/callD.sh 2>&1 | tail -30
echo "done at $SECONDS s"
(cd ${OUT} && tar czf s.tgz s && rm -rf s)
