#!/bin/sh
# A/B, alternating: base (main 3e2b51d) and new (branch cpu-attn), two rounds; then decode.
F=$HOME/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
OUT=$(dirname "$0")
for round in 1 2; do
  for b in base new; do
    echo "== round $round $b pp $(date -u +%H:%M:%S)"
    /tmp/ember-$b bench -m $F --device cpu -t 2 -p 512 -n 0 -d 0,4096,8192 -r 3 > $OUT/pp-r$round-$b.md 2> $OUT/pp-r$round-$b.log
  done
done
for round in 1 2; do
  for b in base new; do
    echo "== round $round $b tg $(date -u +%H:%M:%S)"
    /tmp/ember-$b bench -m $F --device cpu -t 2 -p 0 -n 32 -d 0,4096 -r 3 > $OUT/tg-r$round-$b.md 2> $OUT/tg-r$round-$b.log
  done
done
echo "== done $(date -u +%H:%M:%S)"
