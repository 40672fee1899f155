#!/usr/bin/env bash
# A short call (~330 s) for a session with little device time left: the GPU tests of the work not
# yet run on a GPU (ahead: decode steps queued ahead give the rows of steps run one by one;
# wgmma: the building blocks and which way V's descriptor reads; attention's tiles with
# attention_wg at the wide tiles, against attention_mma_w8 and the reference; model, graph,
# transfers), serve-check at the defaults (decode steps run ahead), bench_attention_mma with
# attention_wg and without, and tg128 with run-ahead against EMBER_RUN_AHEAD=0 on the 35B
# (written meanwhile). No llama.cpp (its build alone takes ~270 s).
set -uo pipefail
L=${LIMIT:-330}
O=${OUT:?}/u; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
E=/tmp/bin/ember; F=/tmp/35b.gguf
($E synth -o $F --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1) & SY=$!
t() { local n=$1; shift; local t0=$SECONDS; env "$@" timeout 150 /tmp/bin/$n --test-threads=1 --nocapture ${FILTER:-} > $O/test-$n${TAG:-}.log 2>&1
  echo "test $n${TAG:-}: exit $? in $(( SECONDS - t0 )) s: $(grep '^test result' $O/test-$n${TAG:-}.log | tail -1)"; }
t wgmma
(FILTER=tile TAG=-wg t attention EMBER_ATTN_WG=1 EMBER_ATTN_MMA_WIDE=1) & AT=$!
t ahead
t model
t graph
t transfers
wait $AT
grep -E 'tiles vs reference|against attention_mma_w8' $O/test-attention-wg.log
timeout 120 python3 bench/gpu/serve-check.py $E > $O/serve-check.log 2>&1
echo "serve-check: exit $?"; grep -E '^(ok|FAIL)' $O/serve-check.log
for v in wg plain; do
  (( SECONDS < L - 40 )) || break
  e=(); [[ $v == plain ]] && e+=(EMBER_ATTN_WG=0)
  env "${e[@]}" timeout 40 /tmp/bin/attention --test-threads=1 --nocapture --ignored bench_attention_mma > $O/bench-attn-$v.log 2>&1
  echo "bench_attention_mma $v: exit $?"; grep '^bench' $O/bench-attn-$v.log
done
wait $SY
for r in 1 2; do
  for v in ahead off; do
    (( SECONDS < L - 25 )) || break 2
    e=(); [[ $v == off ]] && e=(EMBER_RUN_AHEAD=0)
    env "${e[@]}" timeout 40 $E bench -m $F --device cuda -p 0 -n 128 -r 2 > $O/tg-$v-$r.log 2>&1
    echo "tg128 $v round $r: exit $? $(grep -E 'tg128: run' $O/tg-$v-$r.log | awk '{print $4}' | tr '\n' ' ')"
  done
done
echo "done at $SECONDS s"
(cd ${OUT} && tar czf u.tgz u && rm -rf u)
