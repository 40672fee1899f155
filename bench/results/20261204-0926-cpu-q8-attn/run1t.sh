#!/bin/sh
# As run.sh, on 1 thread (the other engineer's build shares the 2 cores; a 2-thread pool waits
# for its slower worker at every op): depths 0 and 8192, round 5 base-new, round 6 new-base.
F=$HOME/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
OUT=$(dirname "$0")
for rb in "5 base" "5 new" "6 new" "6 base"; do
  set -- $rb
  echo "== round $1 $2 1t $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /tmp/ember-$2 bench -m $F --device cpu -t 1 --kv-type q8_0 -p 512 -n 0 -d 0,8192 -r 3 > $OUT/pp1t-r$1-$2.md 2> $OUT/pp1t-r$1-$2.log
  /tmp/ember-$2 bench -m $F --device cpu -t 1 --kv-type q8_0 -p 0 -n 32 -d 0,8192 -r 3 > $OUT/tg1t-r$1-$2.md 2> $OUT/tg1t-r$1-$2.log
done
echo "== done $(date -u +%H:%M:%S)"
