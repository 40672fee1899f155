#!/usr/bin/env bash
# The next session's first call (~480 s on a fresh machine; pack as bench/gpu/README.md says):
# every GPU test binary (the new `ahead`: steps queued ahead give the rows of steps run one by one
# bit for bit; an unfed step does not hang; `wgmma`: the sm_90a building blocks of
# docs/attention-wgmma.md against the host; these two passed on an H100 on 2026-12-07) and serve-check at the tree's defaults, which now run
# decode steps ahead (engine/ahead.rs, docs/backend.md "Running ahead"), while llama.cpp builds
# and the 35B is written; then, while the build finishes, prompt attention's wgmma variants left
# to measure (below); then it waits for the build, so that callS.sh (right after, on the warm
# machine) measures on a quiet host, and callH.sh after that has llama.cpp.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/r; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve timeout $(( L - 20 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
# While llama.cpp builds (GPU idle): prompt attention on wgmma (docs/attention-wgmma.md; the
# wgmma building blocks, V's descriptor and attention_wg were checked on an H100 on 2026-12-07,
# bench/results/20261207-2229-h100-attention-wg; attention_wg is the default since). Left to
# measure: attention_wg for the tiles below 4,096 keys too (EMBER_ATTN_MMA_WIDE=1: wide tiles at
# every depth, where attention_mma's 64-vector tiles run now), its P from shared memory
# (EMBER_ATTN_WG_PS), and steps 1-2 inside the mma kernels (EMBER_ATTN_WGMMA, _PV) for other
# cache types and head sizes; each one's test against the reference, then bench_attention_mma;
# each stops short of the limit.
defs() { case $1 in
  wide) echo "EMBER_ATTN_MMA_WIDE=1";;
  wgps) echo "EMBER_KERNEL_DEFINES=EMBER_ATTN_WG_PS";;
  wgmma2) echo "EMBER_ATTN_WG=0 EMBER_KERNEL_DEFINES=EMBER_ATTN_WGMMA,EMBER_ATTN_WGMMA_PV";;
  mma) echo "EMBER_ATTN_WG=0";;
esac; }
for v in wide wgps wgmma2; do
  (( SECONDS < L - 90 )) || { echo "no time for the $v tests"; break; }
  env $(defs $v) EMBER_ATTN_MMA_WIDE=1 timeout 120 /tmp/bin/attention --test-threads=1 --nocapture tile > $O/test-attn-$v.log 2>&1
  echo "attention tiles ($v, wide): exit $? $(grep -E '^test result|tiles vs reference|against attention_mma_w8' $O/test-attn-$v.log | tr '\n' ' ')"
  (( SECONDS < L - 60 )) || { echo "no time for the $v benchmark"; break; }
  env $(defs $v) timeout 90 /tmp/bin/attention --test-threads=1 --nocapture --ignored bench_attention_mma > $O/bench-attn-$v.log 2>&1
  echo "bench_attention_mma $v: exit $?"; grep '^bench' $O/bench-attn-$v.log
done
for v in default mma; do
  (( SECONDS < L - 45 )) || break
  env $(defs $v) timeout 60 /tmp/bin/attention --test-threads=1 --nocapture --ignored bench_attention_mma > $O/bench-attn-$v.log 2>&1
  echo "bench_attention_mma $v: exit $?"; grep '^bench' $O/bench-attn-$v.log
done
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 15 )); do sleep 2; done
echo "llama.cpp: $( [[ -f /tmp/llama/building ]] && echo still building || echo "built (exit $(cat /tmp/llama/built 2>/dev/null))") at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf r.tgz r && rm -rf r)
