#!/usr/bin/env bash
# The next session's first call (~480 s on a fresh machine; pack as bench/gpu/README.md says):
# every GPU test binary (the new `ahead`: steps queued ahead give the rows of steps run one by one
# bit for bit; an unfed step does not hang; the new `wgmma`: the sm_90a building blocks of
# docs/attention-wgmma.md against the host) and serve-check at the tree's defaults, which now run
# decode steps ahead (engine/ahead.rs, docs/backend.md "Running ahead"), while llama.cpp builds
# and the 35B is written; then, while the build finishes, prompt attention on wgmma
# (EMBER_ATTN_WGMMA: Q·Kᵀ; with EMBER_ATTN_WGMMA_PV also P·V: the test against the reference
# under each, bench_attention_mma plain and under each); then it waits for the build, so that callS.sh (right after, on the warm
# machine) measures on a quiet host, and callH.sh after that has llama.cpp.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/r; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve timeout $(( L - 20 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
# While llama.cpp builds (GPU idle): prompt attention's Q·Kᵀ by wgmma (EMBER_ATTN_WGMMA, step 1 of
# docs/attention-wgmma.md) against the reference, then the attention benchmark both ways.
W=EMBER_KERNEL_DEFINES=EMBER_ATTN_WGMMA; W2=EMBER_KERNEL_DEFINES=EMBER_ATTN_WGMMA,EMBER_ATTN_WGMMA_PV
for v in wgmma wgmma2; do
  e=($W); [[ $v == wgmma2 ]] && e=($W2)
  env "${e[@]}" timeout 150 /tmp/bin/attention --test-threads=1 --nocapture tiles_match_the_reference > $O/test-attn-$v.log 2>&1
  echo "attention tiles with $v: exit $? $(grep -E '^test result|tiles vs reference' $O/test-attn-$v.log | tr '\n' ' ')"
done
for v in plain wgmma wgmma2; do
  e=(); [[ $v == wgmma ]] && e=($W); [[ $v == wgmma2 ]] && e=($W2)
  env "${e[@]}" timeout 120 /tmp/bin/attention --test-threads=1 --nocapture --ignored bench_attention_mma > $O/bench-attn-$v.log 2>&1
  echo "bench_attention_mma $v: exit $?"; grep -v '^running\|^test \|^$' $O/bench-attn-$v.log | tail -8
done
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 15 )); do sleep 2; done
echo "llama.cpp: $( [[ -f /tmp/llama/building ]] && echo still building || echo "built (exit $(cat /tmp/llama/built 2>/dev/null))") at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf r.tgz r && rm -rf r)
