#!/usr/bin/env bash
# The next session's first call (~480 s on a fresh machine): issue 19's table against llama.cpp
# at the defaults (every GPU test passed at them on 2026-12-08,
# bench/results/20261208-0036-h100-moe-route-cluster), llama.cpp built alone on the host first
# (~270 s; the 35B is written beside): pp512, pp8192, tg128 at depth 0 and 32768, one round;
# 16 sequences at depth 4096; then decode steps run ahead against EMBER_RUN_AHEAD=0 (tg128, two
# rounds in turn), which no call has A/B'd yet.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/a; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 150 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout 80 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "batched done at $SECONDS s"
(( SECONDS < L - 50 )) && OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128' VARIANTS="ahead:;off:EMBER_RUN_AHEAD=0" STAGES=variants \
  timeout $(( L - 10 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf a.tgz a && rm -rf a)
