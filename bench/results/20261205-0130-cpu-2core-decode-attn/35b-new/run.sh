#!/bin/bash
M=~/.cache/ember/synth/35b-a3b-q4_k_m-seed0-skew1.gguf
cd "$(dirname "$0")"
cat $M > /dev/null
target/release/ember bench -m $M --device cpu -t 2 -p 0 -n 32 -d 0,4096,32768 -r 1 --kv-type q8_0 -o json > dec35-q8_0-new.json 2> dec35-q8_0-new.log
echo "new done $(date +%T)" >> progress
