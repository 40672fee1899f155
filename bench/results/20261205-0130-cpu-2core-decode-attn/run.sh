#!/bin/bash
# Decode at depth, the fda00c9 build (OLD) against this one (NEW), alternating, 2 threads,
# `small` Q4_K_M; one round into $1 (round 2 took f16 first and new before old).
#   git worktree add /tmp/ember-old fda00c9 && (cd /tmp/ember-old && cargo build --release -p ember-cli)
#   OLD=/tmp/ember-old/target/release/ember NEW=target/release/ember bash run.sh round3
set -eu
M=~/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
mkdir -p "$1" && cd "$1"
for kv in q8_0 f16; do
  for b in old new; do
    bin=$NEW; [ $b = old ] && bin=$OLD
    $bin bench -m $M --device cpu -t 2 -p 0 -n 64 -d 0,32768 -r 1 --kv-type $kv -o json > dec-$kv-$b.json 2> dec-$kv-$b.log
    echo "$kv $b done $(date +%T)" >> progress
  done
done
