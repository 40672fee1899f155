#!/bin/bash
# P·V in bf16 (EMBER_BF16=1, default on AVX-512 BF16) against f32 (EMBER_BF16=0), small, 2 threads, f16 KV.
M=~/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf
cd /work/runs/bf16ab
for r in 1 2; do
  for bf in 1 0; do
    EMBER_BF16=$bf ./ember bench -m $M --device cpu -t 2 -p 2048 -n 0 -d 0,32768 -r 1 -o json > d32k-bf$bf-$r.json 2> d32k-bf$bf-$r.log
    echo "round $r bf16=$bf: $(python3 -c "import json,sys; print(' '.join('pp%d@d%d %.1f' % (x['n_prompt'], x['n_depth'], x['avg_ts']) for x in json.load(open(sys.argv[1]))))" d32k-bf$bf-$r.json)"
  done
done
