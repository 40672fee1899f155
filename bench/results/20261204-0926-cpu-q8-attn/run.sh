#!/bin/sh
# A/B, alternating: base (0db094a: main 0eea76b + attn_bench/run_with, no kernel change) and
# new (2e09b30: integer Q·Kᵀ over a q8_0 KV cache); per round prompts then decode... as run:
#   sh run.sh "1 2" "base new"   (09:26-09:38: rounds 1-2, prompts of both rounds, then decode)
#   sh run.sh "3 4" "new base"   (rounds 3-4, reverse order)
# Binaries copied to /tmp/ember-base and /tmp/ember-new before the run.
F=$HOME/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
OUT=$(dirname "$0")
ROUNDS=${1:-"1 2"}
ORDER=${2:-"base new"}
for round in $ROUNDS; do
  for b in $ORDER; do
    echo "== round $round $b pp $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    /tmp/ember-$b bench -m $F --device cpu -t 2 --kv-type q8_0 -p 512 -n 0 -d 0,4096,8192 -r 3 > $OUT/pp-r$round-$b.md 2> $OUT/pp-r$round-$b.log
  done
done
for round in $ROUNDS; do
  for b in $ORDER; do
    echo "== round $round $b tg $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    /tmp/ember-$b bench -m $F --device cpu -t 2 --kv-type q8_0 -p 0 -n 32 -d 0,4096,8192 -r 3 > $OUT/tg-r$round-$b.md 2> $OUT/tg-r$round-$b.log
  done
done
echo "== done $(date -u +%H:%M:%S)"
