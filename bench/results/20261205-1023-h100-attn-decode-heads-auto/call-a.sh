#!/usr/bin/env bash
# Call 2 (lean): the attention tests, the in-model A/B (auto heads vs 8), the decode-heads
# microbenchmark.
set -uo pipefail
O2=/tmp/o2; mkdir -p $O2; export OUT=$O2
T0=$(date +%s)
STAGES=tests LLAMA=0 SKIP_TESTS=gemv_q8,delta_rule,mailbox,nvrtc_compile,transfers,upload,ember_plan,graph,hybrid,references,ember_cuda,gpu,conformance ./bench/gpu/h200.sh
grep -E "^decode, |panicked" $O2/test-attention.log | head -12
echo "elapsed $(( $(date +%s) - T0 )) s"
STAGES=ab LLAMA=0 ROUNDS=${AB_ROUNDS:-1} AB=EMBER_ATTN_HEADS=8 AB_ARGS="-p 0 -n 128 -d 0,4096,32768" ./bench/gpu/h200.sh
mkdir -p $O2/ab && mv $O2/ab-* $O2/ab/
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 60 /tmp/bin/attention --ignored --nocapture --test-threads=1 bench_attention_decode_heads > $O2/bench-heads.log 2>&1; echo "bench heads: exit $?"
grep -E "decode heads|panicked" $O2/bench-heads.log
