#!/usr/bin/env bash
# Call 1 of 3 on one machine (fresh, ~530 s): llama.cpp's CUDA build started in its own session
# (it runs on under this call and is waited for by call 2) and the full-size 35B written
# (h200.sh's bench stage with no rounds); the one-launch MoE's tests (its kernel against the two
# launches, and inside a model against them); then tg128 at depths 0 and 32768 with it
# (EMBER_MOE_FUSED=1), with the routing in it too (=2), that and the attention's gate in its
# launches (EMBER_ATTN_GATE=1) and attn_prep writing the KV rows (EMBER_ATTN_PREP_KV=1), and without, 2 rounds in turn. The winner
# of tg128's mean at depth 0 goes to /tmp/winner.env for call 2's table. Then, if time is left,
# serve-check.
set -uo pipefail
L=${LIMIT:-540}
O=${OUT:?}/c1; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O STAGES=bench ROUNDS=0 ./bench/gpu/h200.sh 2>&1 | grep -v '^|'
echo "build started, 35B written at $SECONDS s"
for t in "gemv_q8 --exact moe_fused_matches_the_two_launches" "moe_fused" "attention --exact gated_decode_is_attention_then_gate" "gpu --exact attn_prep_writes_the_rows_kv_append_writes"; do
    set -- $t
    timeout 120 /tmp/bin/$1 "${@:2}" --nocapture --test-threads=1 > $O/test-$1.log 2>&1
    echo "test $t: exit $? at $SECONDS s: $(grep -E '^(moe_fused|one-launch|the routing|gated decode:|attn_prep with)' $O/test-$1.log | tail -3 | tr '\n' ' ') $(grep '^test result' $O/test-$1.log)"
    grep -E "panicked|assert" $O/test-$1.log | head -5
done
OUT=$O ROUNDS=2 VARIANT_ARGS='-p 0 -n 128 -d 0,32768' VARIANTS="off:;fused:EMBER_MOE_FUSED=1;routed:EMBER_MOE_FUSED=2;gated:EMBER_MOE_FUSED=2 EMBER_ATTN_GATE=1 EMBER_ATTN_PREP_KV=1" STAGES=variants \
  timeout $(( L - 90 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
python3 - "$O" > /tmp/winner.env <<'PY'
import glob, json, sys
m = {}
for v in ('off', 'fused', 'routed', 'gated'):
    ts = []
    for f in glob.glob(f'{sys.argv[1]}/variant-{v}-*.json'):
        try:
            ts += [x['avg_ts'] for x in json.load(open(f)) if x['n_gen'] and not x.get('n_depth')]
        except Exception:
            pass
    m[v] = sum(ts) / len(ts) if ts else 0.0
best = max(m, key=m.get)
print({'off': 'EMBER_MOE_FUSED=0', 'fused': 'EMBER_MOE_FUSED=1', 'routed': 'EMBER_MOE_FUSED=2', 'gated': 'EMBER_MOE_FUSED=2\nEMBER_ATTN_GATE=1\nEMBER_ATTN_PREP_KV=1'}[best])
print(m, file=sys.stderr)
PY
echo "winner: $(cat /tmp/winner.env)"; cp /tmp/winner.env $O/
(( SECONDS < L - 150 )) && OUT=$O STAGES=serve timeout $(( L - 10 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
ls /tmp/llama/build/bin/ 2>/dev/null | head; grep -c '^\[' /tmp/llama/build.log 2>/dev/null | sed 's/^/llama.cpp build lines: /'
echo "done at $SECONDS s"
