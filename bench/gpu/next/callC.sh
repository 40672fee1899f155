#!/usr/bin/env bash
# Call c (2026-12-06 night): every GPU test binary and serve-check with the norm tails (the
# mixers' output projections and the MoE end their launch with the next norm: NormTail in
# kernels/q8.cuh), llama.cpp built meanwhile (LLAMA=1); decode tg128 with and without the tails
# (EMBER_NORM_TAIL=0), three rounds alternating; then issue 19's table against llama.cpp and batched decode, as far as the time goes.
# Run from the repo root with .gpu carried (bench/gpu/pack.sh); LIMIT = the call's limit_s.
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/c; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
/tmp/bin/gemv_q8 --test-threads=1 --nocapture norm_tails 2>&1 | grep -E "norm tails|panicked|test result" | tee $O/norm-tails.log
OUT=$O VARIANTS='tail:;notail:EMBER_NORM_TAIL=0' VARIANT_ARGS='-p 0 -n 128' ROUNDS=${AB_ROUNDS:-3} STAGES=variants \
  timeout $(( L - 20 - SECONDS > 30 ? L - 20 - SECONDS : 30 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "decode variants done at $SECONDS s"
if (( SECONDS < L - 70 )); then
  OUT=$O ROUNDS=1 PROMPTS=${PROMPTS:-512,8192} DEPTHS=32768 STAGES=bench timeout $(( L - 40 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "bench done at $SECONDS s"
fi
(( SECONDS < L - 45 )) && OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 15 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "batched done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf c.tgz c && rm -rf c)
