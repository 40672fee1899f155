#!/bin/bash
# Decode at depth, HEAD before this change (OLD: 23dd517) against this one (NEW), alternating,
# 2 threads, `small` Q4_K_M (seed 0, skew 1), q8_0 KV (and f16 with KV=f16); one round into $1.
#   git worktree add /tmp/ember-old 23dd517 && (cd /tmp/ember-old && cargo build --release -p ember-cli)
#   OLD=/tmp/ember-old/target/release/ember NEW=target/release/ember bash run.sh round1
set -eu
M=~/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
kv=${KV:-q8_0}
mkdir -p "$1" && cd "$1"
for b in old new; do
  bin=$NEW; [ $b = old ] && bin=$OLD
  $bin bench -m $M --device cpu -t 2 -p 0 -n 64 -d 0,32768 -r 1 --kv-type $kv -o json > dec-$kv-$b.json 2> dec-$kv-$b.log
  echo "$kv $b done $(date +%T)" >> progress
done
