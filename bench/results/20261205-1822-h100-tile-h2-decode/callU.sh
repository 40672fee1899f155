#!/usr/bin/env bash
# Call U (branch mma-h2-decode on main b7c3ad4): llama.cpp builds in the background; the GPU
# tests that run the tensor-core tiles (matmul, gpu, conformance, model, hybrid, graph); A/B of
# the f16x2 tile decoders against the f32 path (EMBER_KERNEL_DEFINES=EMBER_MMA_F32_DECODE);
# the decode step's host/GPU split (EMBER_CUDA_GRAPH_STATS); then issue 19's table.
set -uo pipefail
O=${OUT:?}; export OUT=$O; export EMBER_KERNEL_CACHE=/tmp/kc
nvidia-smi --query-gpu=name --format=csv,noheader
tar -C /tmp -xJf .gpu/bin.tar.xz; mkdir -p /tmp/m /tmp/llama; L=/tmp/llama; touch $L/building
setsid bash -c "cd $L && tar xJf '$PWD/.gpu/llama-src.tar.xz' \
  && cmake -S llama.cpp -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > $L/cmake.log 2>&1 \
  && cmake --build build --target llama-bench llama-completion llama-batched-bench -j 10 > $L/build.log 2>&1; echo \$? > $L/built; rm -f $L/building" \
  < /dev/null > /dev/null 2>&1 &
( /tmp/bin/ember synth -o /tmp/m/35b.gguf.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv /tmp/m/35b.gguf.tmp /tmp/m/35b.gguf ) & SY=$!
mkdir -p $O/t
for n in matmul gpu conformance model hybrid graph; do t0=$(date +%s)
  timeout 150 /tmp/bin/$n --test-threads=1 --nocapture > $O/t/test-$n.log 2>&1
  echo "test $n: exit $? in $(( $(date +%s) - t0 )) s: $(grep '^test result' $O/t/test-$n.log | tail -1)"; grep -h "FAILED\|panicked" $O/t/test-$n.log | head -5; done
grep -h "MEASURED" $O/t/test-matmul.log $O/t/test-gpu.log | head -24
wait $SY; echo "synth: $? at $SECONDS s"
F=/tmp/m/35b.gguf
for r in 1 2; do EMBER_CUDA_GRAPH_STATS=1 timeout 60 /tmp/bin/ember bench -m $F --device cuda -p 0 -n 128 -r 2 > $O/t/graphstats-$r.txt 2>&1
  echo "graph stats $r: $(grep -E 'tg128: run|GRAPH_STATS' $O/t/graphstats-$r.txt | tr '\n' ' ')"; done
mkdir -p $O/t/abh; OUT=$O/t/abh LLAMA=0 STAGES=ab ROUNDS=2 AB=EMBER_KERNEL_DEFINES=EMBER_MMA_F32_DECODE AB_ARGS="-p 512,2048,8192 -n 0" ./bench/gpu/h200.sh 2>&1 | grep "^ab"
# The table runs what the A/B favours (the sum of the mean t/s over the prompt sizes).
WIN=$(python3 -c "
import json,glob,sys
m={}
for v in ('on','off'):
    rows=[x for f in glob.glob('$O/t/abh/ab-%s-*.json'%v) for x in json.load(open(f))]
    m[v]=sum(x['avg_ts'] for x in rows)/max(1,len(rows))
print('off' if m['off']>m['on'] else 'on')" 2>/dev/null || echo on)
echo "A/B favours: $WIN"; [[ $WIN == off ]] && export EMBER_KERNEL_DEFINES=EMBER_MMA_F32_DECODE
(cd $O && tar czf t.tgz t && rm -rf t)
while [[ -f $L/building ]]; do sleep 2; done; echo "llama.cpp built: $(cat $L/built) at $SECONDS s"
mkdir -p $O/b; OUT=$O/b ROUNDS=1 PROMPTS=512,8192 DEPTHS=8192,32768 STAGES=bench,batched ./bench/gpu/h200.sh 2>&1 | tail -16
(cd $O && tar czf b.tgz b && rm -rf b)
echo "done at $SECONDS s"
