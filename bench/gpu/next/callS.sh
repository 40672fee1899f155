#!/usr/bin/env bash
# The Q6_K repack's question before building it (~100 s, any machine, nothing carried):
# gemv-micro's Q6_K shapes (DeltaNet's qkv 8192 x 2048, an expert's down 2048 x 512, the head
# 248,320 x 2048) with the production kernel on the file's 210-byte blocks and `q6r`, the same
# kernel on rows repacked as 208-byte runs plus a plane of d (5 loads a lane and unit, not 17).
set -uo pipefail
O=${OUT:?}/s; mkdir -p $O
nvcc -O3 -std=c++17 -arch=sm_90 -I crates/ember-cuda/kernels -I bench/gpu bench/gpu/gemv-micro.cu -o /tmp/gemv-micro > $O/nvcc.log 2>&1
echo "nvcc: exit $? at $SECONDS s"; tail -5 $O/nvcc.log
Q6_ONLY=1 timeout 150 /tmp/gemv-micro > $O/micro-q6.log 2>&1; echo "micro: exit $? at $SECONDS s"
cat $O/micro-q6.log
