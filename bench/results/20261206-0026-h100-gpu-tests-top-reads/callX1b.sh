#!/usr/bin/env bash
# Call X1b (main 5a1e4b0; little device time left): every GPU test binary while the 35B is
# written, then the decode A/B of the host-wait switches and top reads, as far as time allows.
set -uo pipefail
O=${OUT:?}; export EMBER_KERNEL_CACHE=/tmp/kc; LIM=${LIM:-480}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tar -C /tmp -xJf .gpu/bin.tar.xz; mkdir -p /tmp/m $O/w
( /tmp/bin/ember synth -o /tmp/m/35b.gguf.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/w/synth.log 2>&1 && mv /tmp/m/35b.gguf.tmp /tmp/m/35b.gguf ) & SY=$!
for n in top_k transfers split hybrid gpu matmul conformance model graph attention mailbox delta_rule references upload gemv_q8; do t0=$(date +%s)
  timeout 200 /tmp/bin/$n --test-threads=1 --nocapture > $O/w/test-$n.log 2>&1; rc=$?
  echo "test $n: exit $rc in $(( $(date +%s) - t0 )) s: $(grep '^test result' $O/w/test-$n.log | tail -1)"; grep -h "FAILED\|panicked" $O/w/test-$n.log | head -5; done
(cd $O && tar czf w.tgz w)
wait $SY; echo "synth: $? at $SECONDS s"
F=/tmp/m/35b.gguf
tg() { # tag env...
  local tag=$1; shift
  [[ $SECONDS -gt $LIM ]] && return
  env "$@" timeout 40 /tmp/bin/ember bench -m $F --device cuda -p 0 -n 128 -r 3 -o json > $O/w/tg-$tag.json 2> $O/w/tg-$tag.log
  echo "$tag: $(python3 -c "import json,sys; x=json.load(open(sys.argv[1]))[0]; print('%.1f' % x['avg_ts'], ' '.join('%.1f' % s for s in x['samples_ts']))" $O/w/tg-$tag.json 2>/dev/null) $(grep -o 'host time per one-row step.*' $O/w/tg-$tag.log)"
}
tg warm
tg times EMBER_CUDA_STEP_TIMES=1; tg times-top EMBER_CUDA_STEP_TIMES=1 EMBER_TOP_READS=1
tg times-old EMBER_CUDA_STEP_TIMES=1 EMBER_READ_PINNED=0 EMBER_STEP_UPLOAD_WAIT=1
for r in 1 2; do tg new-$r; tg top-$r EMBER_TOP_READS=1; tg old-$r EMBER_READ_PINNED=0 EMBER_STEP_UPLOAD_WAIT=1; tg top-1block-$r EMBER_TOP_READS=1 EMBER_TOPK_SPLIT=0; done
(cd $O && tar czf w.tgz w && rm -rf w)
echo "done at $SECONDS s"
