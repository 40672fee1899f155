#!/usr/bin/env bash
# First call of the next session (~560 s on a fresh machine; pack with PACK_SKIP=nvrtc_compile,
# bandwidth,model_bench, then move the vocabulary fixture and bench/results out of the checkout so
# the llama.cpp source fits the 64 MiB; keep the BF16 fixture: the GPU tests read it):
#   * every GPU test binary and serve-check at the defaults (Q6_K repacked at upload, g28), with
#     llama.cpp building beside and gemv-micro compiling;
#   * the binaries that run the DeltaNet ops through the model with EMBER_CONV_PREP_FUSED=1 (the
#     conv and the prep in one launch for one-row sequences; `delta_rule` runs the fused kernel
#     against the two launches in any case: `conv_delta_prep_is_the_two_launches`);
#   * gemv-micro's Q6_K shapes (the production kernel on repacked rows);
#   * tg128 with the two launches (the default) against the fused one and against the step's
#     first list at 8 launches (EMBER_CUDA_GRAPH_FIRST=8, never measured), VROUNDS rounds in turn;
#   * issue 19's table against the llama.cpp just built (callH.sh's stages), at the defaults;
#   * a launch trace of tg64 with the fused launch.
# LLAMA=0: no llama.cpp (nor its source in the tree), no table. SKIP_TESTS: the test binaries
# left out (with gemv_q8 among them, its repack test runs alone).
set -uo pipefail
L=${LIMIT:-575}
O=${OUT:?}/w; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
tar -C /tmp -xJf .gpu/bin.tar.xz
(nvcc -O3 -std=c++17 -arch=sm_90 -I crates/ember-cuda/kernels -I bench/gpu bench/gpu/gemv-micro.cu -o /tmp/gemv-micro > $O/nvcc.log 2>&1; echo "exit $?" >> $O/nvcc.log) &
LL=${LLAMA:-1}
SK=${SKIP_TESTS:-nvrtc_compile}
OUT=$O LLAMA=$LL SKIP_TESTS=$SK STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
if [[ ",$SK," == *",gemv_q8,"* ]]; then
  timeout 60 /tmp/bin/gemv_q8 q6k_repack --test-threads=1 > $O/test-gemv_q8-repack.log 2>&1
  echo "gemv_q8 q6k_repack: exit $?: $(grep '^test result' $O/test-gemv_q8-repack.log)"
fi
for t in conformance model hybrid split graph references; do
  EMBER_CONV_PREP_FUSED=1 timeout 120 /tmp/bin/$t --test-threads=1 > "$O/test-$t-fused.log" 2>&1
  echo "EMBER_CONV_PREP_FUSED=1 $t: exit $? at $SECONDS s: $(grep -E '^test result' "$O/test-$t-fused.log" | tail -1)"
done
wait
echo "nvcc: $(tail -1 $O/nvcc.log)"
[[ -x /tmp/gemv-micro ]] && Q6_ONLY=1 timeout 40 /tmp/gemv-micro > $O/micro-q6.log 2>&1; echo "micro: exit $? at $SECONDS s"
grep -E 'rows|prod fill|stg' $O/micro-q6.log | head -16
OUT=$O ROUNDS=${VROUNDS:-2} VARIANT_ARGS='-p 0 -n 128' VARIANTS='two:;fused:EMBER_CONV_PREP_FUSED=1;first8:EMBER_CUDA_GRAPH_FIRST=8' STAGES=variants \
  timeout 120 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
if [[ $LL == 1 ]]; then
  while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 170 )); do sleep 2; done
  echo "llama.cpp build: $(cat /tmp/llama/built 2>/dev/null || echo running) at $SECONDS s"
  OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 75 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "bench done at $SECONDS s"
  (( SECONDS < L - 60 )) && OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 35 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "batched done at $SECONDS s"
fi
if (( SECONDS < L - 30 )); then
  EMBER_CONV_PREP_FUSED=1 EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-fused.txt timeout 25 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-fused.json 2> $O/tr-fused.log
  python3 bench/gpu/trace.py $O/tr-fused.txt > $O/tr-fused.md 2>&1; sed -n 1,30p $O/tr-fused.md
  xz -T4 $O/tr-*.txt 2>/dev/null
fi
echo "done at $SECONDS s"
(cd ${OUT} && tar czf w.tgz w && rm -rf w)
