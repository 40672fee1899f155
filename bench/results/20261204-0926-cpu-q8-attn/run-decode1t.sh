#!/bin/sh
# Decode on 1 thread, three binaries rotated: base (0db094a), new (2e09b30: integer Q·Kᵀ),
# final (d592b93: + decode P·V as gemm_f32); tg64 at depths 0 and 8192, rounds 9-11.
F=$HOME/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
OUT=$(dirname "$0")
for rb in "9 base" "9 new" "9 final" "10 new" "10 final" "10 base" "11 final" "11 base" "11 new"; do
  set -- $rb
  echo "== round $1 $2 tg1t $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /tmp/ember-$2 bench -m $F --device cpu -t 1 --kv-type q8_0 -p 0 -n 64 -d 0,8192 -r 3 > $OUT/tg64-1t-r$1-$2.md 2> $OUT/tg64-1t-r$1-$2.log
done
echo "== done $(date -u +%H:%M:%S)"
