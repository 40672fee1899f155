#!/usr/bin/env bash
# Call I: chain-micro (what a link of dependent kernels costs, by how it waits); every GPU test +
# serve-check at the final tree while llama.cpp b11434 builds; then issue 19's table with ember's
# defaults against it: pp512, pp8192, tg128 at depth 0 and 32768, one round.
set -uo pipefail
O=${OUT:?}/i; mkdir -p $O
nvcc -O3 -std=c++17 -arch=sm_90 bench/gpu/chain-micro.cu -o /tmp/chain-micro > $O/nvcc.log 2>&1; echo "nvcc: exit $? at $SECONDS s"; tail -5 $O/nvcc.log
timeout 60 /tmp/chain-micro 2>&1 | tee $O/chain-micro.txt
echo "chain-micro done at $SECONDS s"
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
grep -h '^test result' $O/test-*.log | sort | uniq -c
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( 575 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | tail -30
echo "bench done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf i.tgz i && rm -rf i)
