#!/usr/bin/env bash
# Q6_K repacked by default (g28), first call on a fresh machine (~500 s; pack with PACK_SKIP=
# nvrtc_compile,bandwidth,model_bench, then move the vocabulary fixture and bench/results out of
# the checkout so the llama.cpp source fits the 64 MiB; keep the BF16 fixture: the GPU tests read
# it): every GPU test binary and serve-check with llama.cpp building beside, gemv-micro's Q6_K
# shapes (the production kernel on the repacked rows), issue 19's table against the llama.cpp
# just built (callH.sh's stages), tg128 with the step's first list at 8 launches
# (EMBER_CUDA_GRAPH_FIRST=8, never measured) against 32, then a launch trace of tg64.
set -uo pipefail
L=${LIMIT:-580}
O=${OUT:?}/u; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
nvcc -O3 -std=c++17 -arch=sm_90 -I crates/ember-cuda/kernels -I bench/gpu bench/gpu/gemv-micro.cu -o /tmp/gemv-micro > $O/nvcc.log 2>&1
echo "nvcc: exit $? at $SECONDS s"; tail -5 $O/nvcc.log
Q6_ONLY=1 timeout 60 /tmp/gemv-micro > $O/micro-q6.log 2>&1; echo "micro: exit $? at $SECONDS s"
cat $O/micro-q6.log
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 150 )); do sleep 2; done
echo "llama.cpp build: $(cat /tmp/llama/built 2>/dev/null || echo running) at $SECONDS s"
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 60 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
(( SECONDS < L - 50 )) && OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 40 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "batched done at $SECONDS s"
(( SECONDS < L - 100 )) && OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS='base:;first8:EMBER_CUDA_GRAPH_FIRST=8' STAGES=variants \
  timeout $(( L - 40 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
if (( SECONDS < L - 30 )); then
  EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-tg64.txt timeout 25 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-tg64.json 2> $O/tr-tg64.log
  python3 bench/gpu/trace.py $O/tr-tg64.txt > $O/tr-tg64.md 2>&1; sed -n 1,30p $O/tr-tg64.md
  xz -T4 $O/tr-*.txt 2>/dev/null
fi
echo "done at $SECONDS s"
(cd ${OUT} && tar czf u.tgz u && rm -rf u)
