#!/usr/bin/env bash
# The next session's first call (~560 s on a fresh machine; pack as bench/gpu/README.md says):
#   * every GPU test binary (the new `ahead`: steps queued ahead give the rows of steps run one
#     by one bit for bit; an unfed step does not hang) and serve-check at the tree's defaults,
#     which now run decode steps ahead (engine/ahead.rs, docs/backend.md "Running ahead");
#     llama.cpp builds beside them (LLAMA=1, default here) for callH.sh after;
#   * run-ahead against EMBER_RUN_AHEAD=0, and run-ahead with a step in one graph
#     (EMBER_AHEAD_FIRST=512: a step queued ahead has no reason to send its first launches
#     early, and the 3-4 boundaries between a step's graphs have no programmatic edge): tg128 (3
#     rounds in turn), the launch traces (1 round: the median step; with run-ahead the host's
#     gap moves into `feed_wait`, module mailbox), 16 sequences at depth 4096 (2 rounds);
#   * callD.sh (the wide Q6_K down, the route's register weights) if time is left.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/r; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=${LLAMA:-1} SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
V="ahead:;off:EMBER_RUN_AHEAD=0;one:EMBER_AHEAD_FIRST=512"
OUT=$O ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' VARIANTS="$V" STAGES=variants timeout 150 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tg128 A/B done at $SECONDS s"
OUT=$O ROUNDS=1 VARIANTS="$V" STAGES=tvariants timeout 150 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
grep -h -E '^\| (mailbox|top_k|get_rows)|launches, [0-9]+ steps' $O/tvariant-*-1.md
echo "traces done at $SECONDS s"
(( SECONDS < L - 90 )) && OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128 -d 4096 --n-seq 16' VARIANTS="ahead:;off:EMBER_RUN_AHEAD=0" STAGES=variants \
  timeout $(( L - 30 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "16 sequences A/B done at $SECONDS s"
(( SECONDS < L - 200 )) && OUT=$O bash bench/gpu/next/callD.sh 2>&1 | tail -30
echo "done at $SECONDS s"
(cd ${OUT} && tar czf r.tgz r && rm -rf r)
