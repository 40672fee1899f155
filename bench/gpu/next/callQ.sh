#!/usr/bin/env bash
# The next session's first call (~520 s on a fresh machine; pack as bench/gpu/README.md says):
#   * every GPU test binary and serve-check at the tree's defaults (the final commit of
#     2026-12-07's g30 session has not run as one binary: its defaults are g30's measured
#     switches), no llama.cpp build (a quiet host for the measurements after);
#   * callD.sh: the Q6_K MoE down at 4 lanes a unit and the route's weights in registers (tests,
#     tg128, launch traces in turn);
#   * Nsight Compute on the one-token MoE's two kernels as they are now, if time is left.
# callH.sh (issue 19's table) needs llama.cpp: LLAMA=1 here builds it beside the tests.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/q; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=${LLAMA:-0} SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
bash bench/gpu/next/callD.sh 2>&1 | tail -40
echo "callD done at $SECONDS s"
(( SECONDS < L - 100 )) && OUT=$O NCU_COUNT=4 NCU_RUNS='tg:moe_gate_up_q8w|moe_down_q8:-p 0 -n 4' STAGES=ncu \
  timeout $(( L - 20 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
(cd ${OUT} && tar czf q.tgz q && rm -rf q)
