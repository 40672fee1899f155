#!/usr/bin/env bash
# Call E (main 1c2f3dd): the prompt bounds together and the 64-token int8 matmul (variants, ember
# only, while llama.cpp builds and the ud-q4_k_m 35B is written), then issue 20's tier table at
# 16 threads against llama.cpp's best fitting -ncmoe.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/w
export UD_SYNTH=1
OUT=$O/w ROUNDS=1 STAGES=variants VARIANTS='new:;old:EMBER_MOE_MMA8_STAGED=0 EMBER_MATMUL_MMA8=0;mm64:EMBER_MATMUL_MMA8_64=1;mm64all:EMBER_MATMUL_MMA8_64=1 EMBER_MATMUL_MMA8_MAX_TOKENS=8192' ./bench/gpu/h200.sh
echo "variants done at $SECONDS s"
(cd $O && tar czf w.tgz w)
OUT=$O/w THREADS=16 STAGES=tier ./bench/gpu/h200.sh
echo "tier done at $SECONDS s"
(cd $O && tar czf w.tgz w && rm -rf w)
