#!/usr/bin/env bash
# Issue 19's table on a warm machine where llama.cpp is built (h200.sh with LLAMA=1 built it)
# against llama.cpp (pp512, pp8192, tg128 at depth 0 and 32768, one round) and 16 sequences'
# decode at depth 4096, ember at its defaults plus TAIL's environment (VAR=value ..., default none).
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/h; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
T=(${TAIL:-})
env "${T[@]}" OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 130 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
(( SECONDS < L - 60 )) && env "${T[@]}" OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 15 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "batched done at $SECONDS s"
(cd ${OUT} && tar czf h.tgz h && rm -rf h)
