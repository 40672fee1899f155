#!/usr/bin/env bash
# Call 2 of 3 (warm, right after call 1): issue 19's table, ember (with call 1's winner,
# /tmp/winner.env) against llama.cpp b11434 built in call 1, one round: pp512, pp8192, tg128 at
# depths 0 and 32768; then 16 sequences at depth 4096 (ember's `--n-seq 1,16` against
# llama-batched-bench), one round.
set -uo pipefail
L=${LIMIT:-585}
O=${OUT:?}/c2; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -f /tmp/winner.env ]] && set -a && . /tmp/winner.env && set +a
echo "EMBER_MOE_FUSED=${EMBER_MOE_FUSED:-unset} EMBER_ATTN_GATE=${EMBER_ATTN_GATE:-unset} EMBER_ATTN_PREP_KV=${EMBER_ATTN_PREP_KV:-unset}"
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 130 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 5 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
