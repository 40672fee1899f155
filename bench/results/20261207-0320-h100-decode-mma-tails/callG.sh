#!/usr/bin/env bash
# Session 2026-12-07's first call (callF plus the decode path on tensor cores, cut to fit one
# call): every GPU test binary and serve-check at the tree (LLAMA=1 builds llama.cpp meanwhile;
# the attention binary now holds decode_mma_matches_the_decode_kernel), and beside them gpu /
# conformance / model / graph / hybrid with EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1; serve-check
# with the tails; bench_attention_decode_mma under its entries (w4s2 the default, w4s3, w2s2);
# decode tg128 at depth 0 without and with both tails and at depth 32768 with the tails on the
# scalar and the tensor-core decode attention (2 rounds, alternating); then llama.cpp's tg128 at
# depth 0 and 32768 (llama-bench -r 2) for the ratios.
# 2026-12-07: the delta rule's gated-norm tail (EMBER_DELTA_NORM_TAIL=1) joins the tails' tests
# and serve-check, and a third depth-0 variant (three tails).
# A short form: LLAMA=0 ADM=w4s2 VROUNDS=1 (no llama.cpp, one micro entry, one round each).
# Run from the repo root with .gpu carried (bench/gpu/pack.sh); LIMIT = the call's limit_s.
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/g; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
# The tensor-core decode attention is off by default in the committed tree (EMBER_ATTN_DECODE_MMA=1
# turns it on): the tails' tests beside the stage run with it on, and the attention binary again.
( for t in gpu conformance model graph hybrid; do
    EMBER_ATTN_DECODE_MMA=1 EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1 EMBER_DELTA_NORM_TAIL=1 timeout 200 /tmp/bin/$t --test-threads=1 > $O/test-tail-$t.log 2>&1 &
  done
  EMBER_ATTN_DECODE_MMA=1 timeout 200 /tmp/bin/attention --test-threads=1 --nocapture > $O/test-adm-attention.log 2>&1 &
  wait ) &
SW=$!
OUT=$O LLAMA=${LLAMA:-1} SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
wait $SW
for f in $O/test-tail-*.log $O/test-adm-attention.log; do echo "$(basename $f): $(grep -E '^test result' $f | tail -1)"; done
grep -h "norm tails:\|tensor cores" $O/test-gemv_q8.log $O/test-adm-attention.log
EMBER_ATTN_DECODE_MMA=1 EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1 EMBER_DELTA_NORM_TAIL=1 timeout 100 python3 bench/gpu/serve-check.py /tmp/bin/ember > $O/serve-check-tail.log 2>&1; echo "serve-check (tails): exit $?"
for v in ${ADM:-w4s2 w4s3 w2s2}; do
  (( SECONDS < L - 160 )) || break
  EMBER_ATTN_DECODE_MMA=$v timeout 40 /tmp/bin/attention --ignored --test-threads=1 --nocapture --exact bench_attention_decode_mma > "$O/micro-adm-$v.log" 2>&1
  echo "micro $v: exit $?"; grep -E '^decode mma' "$O/micro-adm-$v.log" | sed 's/^decode mma //'
done
echo "micro done at $SECONDS s"
(( SECONDS < L - 130 )) && OUT=$O VARIANTS='base:;both:EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1;three:EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1 EMBER_DELTA_NORM_TAIL=1' VARIANT_ARGS='-p 0 -n 128' ROUNDS=${VROUNDS:-2} STAGES=variants \
  timeout $(( L - 80 - SECONDS > 30 ? L - 80 - SECONDS : 30 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "decode variants done at $SECONDS s"
(( SECONDS < L - 70 )) && OUT=$O VARIANTS='dscalar:EMBER_ATTN_DECODE_MMA=0 EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1;dmma:EMBER_ATTN_DECODE_MMA=1 EMBER_NORM_TAIL=1 EMBER_ROUTE_TAIL=1' VARIANT_ARGS='-p 0 -n 128 -d 32768' ROUNDS=${VROUNDS:-2} STAGES=variants \
  timeout $(( L - 12 - SECONDS > 20 ? L - 12 - SECONDS : 20 )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "depth variants done at $SECONDS s"
LB=/tmp/llama/build/bin/llama-bench
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 50 )); do sleep 2; done
if [[ -x $LB ]] && (( SECONDS < L - 45 )); then
  timeout $(( L - 12 - SECONDS )) $LB -m /tmp/m/35b.gguf -ngl 99 -fa 1 -p 0 -n 128 -d 0,32768 -r 2 -o json > $O/llama-tg.json 2> $O/llama-tg.log
  echo "llama.cpp tg: exit $? $(python3 -c "import json,sys; print(' '.join('tg%d@d%d %.1f' % (x['n_gen'], x['n_depth'], x['avg_ts']) for x in json.load(open(sys.argv[1]))))" $O/llama-tg.json 2>/dev/null)"
fi
echo "llama done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf g.tgz g && rm -rf g)
