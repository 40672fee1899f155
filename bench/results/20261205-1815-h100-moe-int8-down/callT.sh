#!/usr/bin/env bash
# Call T (main + the int8 MoE down, uncommitted): the GPU tests that run the MoE (gpu: the int8
# down against the reference on h's int8 round trip; conformance, model, hybrid, graph), the
# MoE microbenchmark, A/B EMBER_MOE_MMA8_DOWN=0 at 512 / 1024 tokens (2048: both forms off,
# a control), then kernel profiles of pp512 and of one sequence's decode.
set -uo pipefail
O=${OUT:?}; export OUT=$O; export EMBER_KERNEL_CACHE=/tmp/kc
nvidia-smi --query-gpu=name --format=csv,noheader
tar -C /tmp -xJf .gpu/bin.tar.xz; mkdir -p /tmp/m
( /tmp/bin/ember synth -o /tmp/m/35b.gguf.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv /tmp/m/35b.gguf.tmp /tmp/m/35b.gguf ) & SY=$!
mkdir -p $O/t
for n in gpu conformance model hybrid graph; do t0=$(date +%s)
  timeout 150 /tmp/bin/$n --test-threads=1 --nocapture > $O/t/test-$n.log 2>&1
  echo "test $n: exit $? in $(( $(date +%s) - t0 )) s: $(grep '^test result' $O/t/test-$n.log | tail -1)"; grep -h "FAILED\|panicked" $O/t/test-$n.log | head -5; done
grep -h "MOE_MMA_MEASURED" $O/t/test-gpu.log
timeout 150 /tmp/bin/gpu --ignored --nocapture --test-threads=1 --exact bench_moe_prompt > $O/t/micro-moe.log 2>&1; grep "^bench" $O/t/micro-moe.log
wait $SY; echo "synth: $? at $SECONDS s"
mkdir -p $O/t/abdn; OUT=$O/t/abdn LLAMA=0 STAGES=ab ROUNDS=2 AB=EMBER_MOE_MMA8_DOWN=0 AB_ARGS="-p 512,1024,2048 -n 0" ./bench/gpu/h200.sh 2>&1 | grep "^ab"
F=/tmp/m/35b.gguf
EMBER_CUDA_PROFILE=1 timeout 60 /tmp/bin/ember bench -m $F --device cuda -p 512 -n 0 -r 1 > $O/t/kprofile-pp512.txt 2>&1
EMBER_CUDA_PROFILE=1 timeout 90 /tmp/bin/ember bench -m $F --device cuda -p 0 -n 32 -r 1 > $O/t/kprofile-tg32.txt 2>&1
head -22 $O/t/kprofile-pp512.txt | tail -17; head -30 $O/t/kprofile-tg32.txt | tail -25
(cd $O && tar czf t.tgz t && rm -rf t)
echo "done at $SECONDS s"
