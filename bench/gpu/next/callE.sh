#!/usr/bin/env bash
# Call e (2026-12-06 night, ~6 minutes of device time left): the GPU tests the norm tails touch
# (gemv_q8's norm_tails, fused_q8 and moe_q8 tests; gpu, conformance, model, graph, hybrid; the
# server end to end) while `ember synth` writes the 35B; then tg128 with and without the tails
# (EMBER_NORM_TAIL=0), alternating, rounds while the time lasts. No llama.cpp (its build alone
# takes longer than what is left). Run from the repo root with .gpu carried; LIMIT = limit_s.
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/e; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember; F=/tmp/m/35b.gguf; mkdir -p /tmp/m
( t0=$SECONDS; $E synth -o $F.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv $F.tmp $F; echo "synth: $(( SECONDS - t0 )) s" ) &
SY=$!
for t in gpu conformance model graph hybrid; do timeout 150 /tmp/bin/$t --test-threads=1 > $O/test-$t.log 2>&1 & done
timeout 150 /tmp/bin/gemv_q8 --test-threads=1 --nocapture norm_tails fused_q8 moe_q8 > $O/test-gemv_q8.log 2>&1 &
timeout 100 python3 bench/gpu/serve-check.py $E > $O/serve-check.log 2>&1; echo "serve-check: exit $?"; grep -E '^(ok|FAIL)' $O/serve-check.log
wait $SY
while jobs -r | grep -q .; do sleep 1; (( SECONDS > L - 40 )) && break; done
for t in gpu conformance model graph hybrid gemv_q8; do echo "test $t: $(grep -E '^test result' $O/test-$t.log | tail -1)"; done
grep -E "norm tails|moe_q8:" $O/test-gemv_q8.log
echo "tests done at $SECONDS s"
j() { python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$1" 2>/dev/null; }
for r in 1 2 3 4; do
  (( SECONDS < L - 25 )) || break
  $E bench -m $F --device cuda -p 0 -n 128 -r 2 -o json > $O/tail-$r.json 2> $O/tail-$r.log; echo "round $r tails: $(j $O/tail-$r.json) at $SECONDS s"
  (( SECONDS < L - 12 )) || break
  EMBER_NORM_TAIL=0 $E bench -m $F --device cuda -p 0 -n 128 -r 2 -o json > $O/notail-$r.json 2> $O/notail-$r.log; echo "round $r EMBER_NORM_TAIL=0: $(j $O/notail-$r.json) at $SECONDS s"
done
(cd ${OUT} && tar czf e.tgz e && rm -rf e)
