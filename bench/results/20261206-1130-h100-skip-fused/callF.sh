#!/usr/bin/env bash
# Call F: how soon the GPU gets a step's first kernels: the first recorded list's launches
# (EMBER_CUDA_GRAPH_FIRST, default 32) at 32 / 8 / 16, tg128 on the 35B, three rounds in turn.
set -uo pipefail
O=${OUT:?}/f; mkdir -p $O /tmp/m
tar -C /tmp -xJf .gpu/bin.tar.xz
export EMBER_KERNEL_CACHE=/tmp/kc
/tmp/bin/ember synth -o /tmp/m/35b.gguf --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1; echo "synth: exit $? at $SECONDS s"
nvidia-smi --query-gpu=name,driver_version --format=csv > $O/gpu.txt
for r in 1 2 3; do
  for v in 32 8 16; do
    EMBER_CUDA_GRAPH_FIRST=$v timeout 40 /tmp/bin/ember bench -m /tmp/m/35b.gguf --device cuda -p 0 -n 128 -r 2 -o json > $O/first$v-$r.json 2> $O/first$v-$r.log
    echo "first $v round $r: exit $? $(python3 -c "import json,sys; print([round(x['avg_ts'],1) for x in json.load(open(sys.argv[1]))])" $O/first$v-$r.json 2>/dev/null)"
  done
  (( SECONDS > 200 )) && break
done
echo "done at $SECONDS s"
