#!/usr/bin/env bash
# The first call of the session of 2026-12-07 13:00 (~575 s on a fresh machine; pack with
# PACK_SKIP=nvrtc_compile,bandwidth,model_bench, then move the vocabulary fixture and bench/results
# out of the checkout so the llama.cpp source fits the 64 MiB):
#   * the test binaries the day's kernels touch, at the defaults: delta_rule (with
#     conv_delta_prep_is_the_two_launches and delta_rule_norm_is_the_two_launches), gemv_q8
#     (beside: the Q6_K repack's partial-write half), gpu; llama.cpp building meanwhile;
#   * the binaries that run the DeltaNet ops through the model, and serve-check, with both fusions
#     on (EMBER_CONV_PREP_FUSED=1: the conv and the prep in one launch; EMBER_DELTA_NORM_FUSED=1:
#     the delta rule and its gated norm in one launch);
#   * tg128 with neither, each, and both (VROUNDS rounds in turn), once llama.cpp has built;
#   * issue 19's table against llama.cpp with both fusions on (callH.sh's stages);
#   * a launch trace of tg64 with both.
# LLAMA=0: no llama.cpp (nor its source in the tree), no table.
set -uo pipefail
L=${LIMIT:-575}
O=${OUT:?}/x; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
FUSED="EMBER_CONV_PREP_FUSED=1 EMBER_DELTA_NORM_FUSED=1"
tar -C /tmp -xJf .gpu/bin.tar.xz
LL=${LLAMA:-1}
OUT=$O LLAMA=$LL TESTS_BESIDE=gemv_q8 SKIP_TESTS=nvrtc_compile,attention,mailbox,upload,top_k,transfers,matmul,conformance,model,hybrid,split,graph,references \
  STAGES=tests ./bench/gpu/h200.sh
echo "tests done at $SECONDS s"
for t in conformance model hybrid split graph references; do
  env $FUSED timeout 120 /tmp/bin/$t --test-threads=1 > "$O/test-$t-fused.log" 2>&1
  echo "fused $t: exit $? at $SECONDS s: $(grep -E '^test result' "$O/test-$t-fused.log" | tail -1)"
done
env $FUSED timeout 150 python3 bench/gpu/serve-check.py $E > "$O/serve-check-fused.log" 2>&1
echo "serve-check (fused): exit $? at $SECONDS s"; grep -E '^(ok|FAIL)' "$O/serve-check-fused.log"
if [[ $LL == 1 ]]; then
  while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 250 )); do sleep 2; done
  echo "llama.cpp build: $(cat /tmp/llama/built 2>/dev/null || echo running) at $SECONDS s"
fi
OUT=$O ROUNDS=${VROUNDS:-2} VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS="two:;prep:EMBER_CONV_PREP_FUSED=1;norm:EMBER_DELTA_NORM_FUSED=1;both:$FUSED" STAGES=variants \
  timeout 170 ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
if [[ $LL == 1 ]] && (( SECONDS < L - 100 )); then
  env $FUSED OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 60 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "bench done at $SECONDS s"
  (( SECONDS < L - 55 )) && env $FUSED OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 30 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "batched done at $SECONDS s"
fi
if (( SECONDS < L - 25 )); then
  env $FUSED EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-both.txt timeout 20 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-both.json 2> $O/tr-both.log
  python3 bench/gpu/trace.py $O/tr-both.txt > $O/tr-both.md 2>&1; sed -n 1,28p $O/tr-both.md
  xz -T4 $O/tr-*.txt 2>/dev/null
fi
echo "done at $SECONDS s"
(cd ${OUT} && tar czf x.tgz x && rm -rf x)
