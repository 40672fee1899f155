#!/usr/bin/env bash
# cuda-graph helper run 2: GPU tests, then ember bench: graphs off / on (chunks up to 256) /
# on (one list per step), alternating; then tg128 per chunk size with flush GPU time.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/logs; mkdir -p $L
export EMBER_KERNEL_CACHE=/tmp/kc
T0=$(date +%s)
tar -C /tmp -xJf .gpu/graph/bin.tar.xz
B=/tmp/gbin; F=/tmp/35b.gguf
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee $L/gpu.txt
if [[ ! -s $F ]]; then ( t0=$(date +%s); $B/ember synth -o $F.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $L/synth.log 2>&1 && mv $F.tmp $F; echo "synth exit $? in $(( $(date +%s)-t0 )) s" >> $L/synth.log ) & fi
SY=$!
for n in graph conformance model gpu references attention delta_rule upload; do
  t0=$(date +%s); timeout 100 $B/$n --test-threads=1 --nocapture > $L/test-$n.log 2>&1
  echo "test $n: exit $? in $(( $(date +%s)-t0 )) s: $(grep '^test result' $L/test-$n.log | tail -1)"
done
grep -h "add chains\|logit rows\|panicked" $L/test-*.log | head -30
wait $SY 2>/dev/null; tail -1 $L/synth.log 2>/dev/null
run() { local tag=$1; shift; (( $(date +%s)-T0 > 240 )) && { echo "skip $tag: out of time"; return; }
  local t0=$(date +%s); env "$@" EMBER_CUDA_GRAPH_STATS=1 timeout 40 $B/ember bench -m $F --device cuda $BA > $L/$tag.md 2> $L/$tag.err
  echo "$tag ($*): exit $? in $(( $(date +%s)-t0 )) s"; grep -E "^\| ember" $L/$tag.md | cut -d'|' -f7,8; grep "CUDA graphs" $L/$tag.err; }
BA="-p 512 -n 64 -d 0,8192 -r 2"
for r in 1 2; do
  run off-$r EMBER_CUDA_GRAPH=0
  run on256-$r EMBER_CUDA_GRAPH=1
  run onall-$r EMBER_CUDA_GRAPH=1 EMBER_CUDA_GRAPH_CHUNK=1000000
done
BA="-p 0 -n 128 -r 1"
for c in 1000000 64 128 256 512; do run tg-c$c EMBER_CUDA_GRAPH=1 EMBER_CUDA_GRAPH_CHUNK=$c; done
run tg-off EMBER_CUDA_GRAPH=0
tar -C $O -czf $O/logs.tgz logs && rm -rf $L
echo "total $(( $(date +%s)-T0 )) s"
