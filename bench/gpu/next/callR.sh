#!/usr/bin/env bash
# The next session's first call (~480 s on a fresh machine; pack as bench/gpu/README.md says):
# every GPU test binary (the new `ahead`: steps queued ahead give the rows of steps run one by one
# bit for bit; an unfed step does not hang; the new `wgmma`: the sm_90a building blocks of
# docs/attention-wgmma.md against the host) and serve-check at the tree's defaults, which now run
# decode steps ahead (engine/ahead.rs, docs/backend.md "Running ahead"), while llama.cpp builds
# and the 35B is written; then, while the build finishes, prompt attention on wgmma
# (attention_wg, EMBER_ATTN_WG=1; EMBER_ATTN_WGMMA: Q·Kᵀ; with EMBER_ATTN_WGMMA_PV also P·V: the
# test against the reference under each, bench_attention_mma plain and under each); then it waits for the build, so that callS.sh (right after, on the warm
# machine) measures on a quiet host, and callH.sh after that has llama.cpp.
set -uo pipefail
L=${LIMIT:-560}
O=${OUT:?}/r; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve timeout $(( L - 20 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "tests+serve done at $SECONDS s"
# While llama.cpp builds (GPU idle): prompt attention on wgmma (docs/attention-wgmma.md). First
# which way the GPU reads V's descriptor (tests/wgmma.rs, run above with the other tests, tries
# (8192, 1024) then the swap; EMBER_ATTN_V_SWAP takes the swap), then, most telling first, each
# variant's test against the reference at the wide tiles (128 query vectors, attention_mma_w8's
# shape) and the benchmark: wg = attention_wg (EMBER_ATTN_WG=1, step 3: both products on wgmma,
# pages two deep, the softmax beside P·V), wgps = the same with P·V's P from shared memory
# (EMBER_ATTN_WG_PS), wgmma2 = EMBER_ATTN_WGMMA + _PV (step 2), wgmma =
# EMBER_ATTN_WGMMA (step 1, S only); each stops short of the limit.
SW=
grep -q "with (1024, 8192) it matches: true" $O/test-wgmma.log 2>/dev/null && SW=EMBER_ATTN_V_SWAP
echo "wgmma: $(grep -E '^V offsets|^test result' $O/test-wgmma.log 2>/dev/null | tr '\n' ' ') -> V swap: ${SW:-no}"
defs() { case $1 in
  plain) echo "${SW:+EMBER_KERNEL_DEFINES=$SW}";;
  wg) echo "${SW:+EMBER_KERNEL_DEFINES=$SW} EMBER_ATTN_WG=1";;
  wgps) echo "EMBER_KERNEL_DEFINES=EMBER_ATTN_WG_PS${SW:+,$SW} EMBER_ATTN_WG=1";;
  wgmma2) echo "EMBER_KERNEL_DEFINES=EMBER_ATTN_WGMMA,EMBER_ATTN_WGMMA_PV${SW:+,$SW}";;
  wgmma) echo "EMBER_KERNEL_DEFINES=EMBER_ATTN_WGMMA";;
esac; }
for v in wg wgps wgmma2 wgmma; do
  (( SECONDS < L - 90 )) || { echo "no time for the $v tests"; break; }
  tests=tiles_match_the_reference; [[ $v == wg* ]] && tests=tile
  env $(defs $v) EMBER_ATTN_MMA_WIDE=1 timeout 120 /tmp/bin/attention --test-threads=1 --nocapture $tests > $O/test-attn-$v.log 2>&1
  echo "attention tiles ($v, wide): exit $? $(grep -E '^test result|tiles vs reference|against attention_mma_w8' $O/test-attn-$v.log | tr '\n' ' ')"
  (( SECONDS < L - 60 )) || { echo "no time for the $v benchmark"; break; }
  env $(defs $v) timeout 90 /tmp/bin/attention --test-threads=1 --nocapture --ignored bench_attention_mma > $O/bench-attn-$v.log 2>&1
  echo "bench_attention_mma $v: exit $?"; grep '^bench' $O/bench-attn-$v.log
done
if (( SECONDS < L - 45 )); then
  env $(defs plain) timeout 60 /tmp/bin/attention --test-threads=1 --nocapture --ignored bench_attention_mma > $O/bench-attn-plain.log 2>&1
  echo "bench_attention_mma plain: exit $?"; grep '^bench' $O/bench-attn-plain.log
fi
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 15 )); do sleep 2; done
echo "llama.cpp: $( [[ -f /tmp/llama/building ]] && echo still building || echo "built (exit $(cat /tmp/llama/built 2>/dev/null))") at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf r.tgz r && rm -rf r)
