#!/usr/bin/env bash
# Call S: every GPU test binary + serve-check with gemv_q8_mixed and delta_rule_seqs_prep on by
# default (llama.cpp builds meanwhile in its own session), then their A/B on tg128 (full 35B,
# three rounds in turn): both on / both off / each alone.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/s
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $O/s/gpu.txt
OUT=$O/s SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
grep -h "delta_rule_seqs_prep\|gemv_q8:" $O/s/test-delta_rule.log $O/s/test-gemv_q8.log
grep -h "delta_prep_rule" $O/s/test-conformance.log | head -5
OUT=$O/s LLAMA=0 STAGES=variants ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS='both:;off:EMBER_GEMV_MIXED=0 EMBER_DELTA_PREP_FUSED=0;mixed:EMBER_DELTA_PREP_FUSED=0;fused:EMBER_GEMV_MIXED=0' ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && tar czf s.tgz s && rm -rf s)
