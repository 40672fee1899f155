#!/bin/sh
# Decode A/B of base (0db094a) and final (d592b93: integer Q·Kᵀ + decode P·V as gemm_f32 over
# chunks of value rows), alternating, 2 threads (depths 0, 4096, 8192) and 1 thread (0, 8192);
# round 7 base first, round 8 final first. Binaries in /tmp/ember-base, /tmp/ember-final.
F=$HOME/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
OUT=$(dirname "$0")
for rb in "7 base" "7 final" "8 final" "8 base"; do
  set -- $rb
  echo "== round $1 $2 tg $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /tmp/ember-$2 bench -m $F --device cpu -t 2 --kv-type q8_0 -p 0 -n 32 -d 0,4096,8192 -r 3 > $OUT/tg-r$1-$2.md 2> $OUT/tg-r$1-$2.log
  /tmp/ember-$2 bench -m $F --device cpu -t 1 --kv-type q8_0 -p 0 -n 32 -d 0,8192 -r 3 > $OUT/tg1t-r$1-$2.md 2> $OUT/tg1t-r$1-$2.log
done
echo "== done $(date -u +%H:%M:%S)"
