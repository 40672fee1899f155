#!/usr/bin/env bash
# On the GPU machine (repo root, .gpu/ from `PACK_SKIP=... bench/gpu/pack.sh` carried: ember and
# the switches, gpu, gemv_q8 and hybrid test binaries): the decode switches built in g18
# (docs/perf.md), ~4-5 minutes. Their bits against the plain kernels (tests/switches.rs), then
# tg128 on a 16-layer cut of the 35B shape (synthesised here, ~30 s) with each switch and all
# together, and with DeltaNet's 13.8 MB Q6_K qkv on gemv_q8_rows (EMBER_GEMV_ROWS_MIN_MIB=8),
# alternating, ROUNDS rounds (default 2), then the route, MoE and tier tests with them on. Logs
# under $OUT/ab.
set -uo pipefail
O=${OUT:?}/ab; mkdir -p $O; M=/tmp/m; mkdir -p $M
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember && /tmp/bin/ember -nt .gpu/bin.tar.xz ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $O/gpu.txt
F=$M/cut16.gguf
if [[ ! -s $F ]]; then
    ( $E synth -o $F.tmp --config '{"n_layer": 16}' --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv $F.tmp $F; echo "synth: exit $? at $SECONDS s" ) &
    SY=$!
else
    SY=
fi
timeout 120 /tmp/bin/switches --nocapture > $O/test-switches.log 2>&1
echo "switches: exit $? $(grep -E '^test result|outputs' $O/test-switches.log | tr '\n' ' ')"
[[ -n $SY ]] && wait $SY
ALL=EMBER_ROUTE_REDUX,EMBER_MOE_GU_UNROLL,EMBER_MOE_SHARED_FIRST
V=("plain:" "route:EMBER_KERNEL_DEFINES=EMBER_ROUTE_REDUX" "unroll:EMBER_KERNEL_DEFINES=EMBER_MOE_GU_UNROLL"
   "shared:EMBER_KERNEL_DEFINES=EMBER_MOE_SHARED_FIRST" "all:EMBER_KERNEL_DEFINES=$ALL"
   "rows:EMBER_GEMV_ROWS_MIN_MIB=8")
for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in "${V[@]}"; do
        name=${v%%:*}; envs=(${v#*:})
        env "${envs[@]}" timeout 60 $E bench -m $F --device cuda -p 0 -n 128 -r 3 -o json > $O/v-$name-$r.json 2> $O/v-$name-$r.log
        echo "$name round $r: exit $? $(python3 -c "import json,sys; print(' '.join('%.1f' % x['avg_ts'] for x in json.load(open(sys.argv[1]))))" $O/v-$name-$r.json 2>/dev/null) at $SECONDS s"
    done
done
# t BINARY FILTER (empty: all its tests), with every switch on.
t() { local n=$1 f=$2
      EMBER_KERNEL_DEFINES=$ALL timeout 150 /tmp/bin/$n $f --test-threads=1 --nocapture > $O/test-$n-on.log 2>&1
      echo "$n $f with every switch: exit $? $(grep '^test result' $O/test-$n-on.log)"; }
t gpu route
t gemv_q8 moe_q8
t hybrid ""
