#!/usr/bin/env bash
# The next session's first call (~500 s), on a fresh machine: the tree's defaults checked (every
# GPU test binary and serve-check; llama.cpp builds beside them), bench_attention_decode_mma
# (now with one and four deep rows at 128 and 256 ranges a row), then Nsight Compute on the two
# things issue 19's open targets wait on: the prompt attention at depth (attention_mma on a
# 512-token chunk at depth 8192: its stall reasons, for the wgmma step docs/perf.md g25 names)
# and one-token decode's MoE (the wide gate/up, the down). `callH.sh` runs issue 19's table next on
# the warm machine; `callD.sh` the wide down.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/p; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=${LLAMA:-1} SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
timeout 60 /tmp/bin/attention --ignored --test-threads=1 --nocapture --exact bench_attention_decode_mma > $O/micro-adm.log 2>&1
echo "micro: exit $?"; grep -E '^decode mma' $O/micro-adm.log | sed 's/^decode mma //' | grep -E "depth (8192|32768)"
(( SECONDS < L - 120 )) && OUT=$O NCU_COUNT=4 \
  NCU_RUNS='pd8k:attention_mma:-p 512 -n 0 -d 8192;tg:moe_gate_up_q8w|moe_down_q8_q:-p 0 -n 4' STAGES=ncu \
  timeout $(( L - 20 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
(cd ${OUT} && tar czf p.tgz p && rm -rf p)
