#!/usr/bin/env bash
# Call 3 of 3 (warm): every GPU test binary at the tree's defaults (the two slowest beside the
# rest), then the model's binaries again with the one-launch MoE and its routing on (=2); run-ahead against
# EMBER_RUN_AHEAD=0 (tg128, 2 rounds in turn) if time is left.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/c3; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
OUT=$O LLAMA=0 SYNTH=0 SKIP_TESTS=nvrtc_compile STAGES=tests timeout $(( L - 200 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests done at $SECONDS s"
mkdir -p $O/fused
for t in model conformance references graph ahead hybrid split attention; do
    [[ -x /tmp/bin/$t ]] || continue
    EMBER_MOE_FUSED=2 EMBER_ATTN_GATE=1 EMBER_ATTN_PREP_KV=1 timeout 120 /tmp/bin/$t --nocapture --test-threads=1 > $O/fused/test-$t.log 2>&1
    echo "fused: test $t: exit $? at $SECONDS s: $(grep '^test result' $O/fused/test-$t.log)"
done
(( SECONDS < L - 100 )) && OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128' VARIANTS="ahead:;off:EMBER_RUN_AHEAD=0" STAGES=variants \
  timeout $(( L - 5 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
