#!/usr/bin/env bash
# Call Q (branch gpu-all = moe-mma8 + compute-by-batch): llama.cpp and both 35B files build in
# the background; every GPU test binary; the prompt micro-benchmarks; then (llama.cpp built, CPU
# quiet) in-model A/Bs EMBER_MOE_MMA8=0 and EMBER_MMA8=0.
set -uo pipefail
O=${OUT:?}; export OUT=$O; export EMBER_KERNEL_CACHE=/tmp/kc
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
tar -C /tmp -xJf .gpu/bin.tar.xz; mkdir -p /tmp/m /tmp/llama; L=/tmp/llama; touch $L/building
setsid bash -c "cd $L && tar xJf '$PWD/.gpu/llama-src.tar.xz' \
  && cmake -S llama.cpp -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > $L/cmake.log 2>&1 \
  && cmake --build build --target llama-bench llama-completion llama-batched-bench -j 10 > $L/build.log 2>&1; echo \$? > $L/built; rm -f $L/building" \
  < /dev/null > /dev/null 2>&1 &
touch /tmp/m/35b-ud.gguf.synthing
setsid bash -c "/tmp/bin/ember synth -o /tmp/m/35b-ud.gguf.tmp --preset 35b-a3b --quant ud-q4_k_m --seed 0 --skew 1 > /tmp/m/synth-ud.log 2>&1 \
  && mv /tmp/m/35b-ud.gguf.tmp /tmp/m/35b-ud.gguf; rm -f /tmp/m/35b-ud.gguf.synthing" < /dev/null > /dev/null 2>&1 &
( /tmp/bin/ember synth -o /tmp/m/35b.gguf.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv /tmp/m/35b.gguf.tmp /tmp/m/35b.gguf ) & SY=$!
mkdir -p $O/t
for n in gpu matmul conformance model hybrid graph attention mailbox delta_rule references upload transfers gemv_q8; do t0=$(date +%s)
  timeout 150 /tmp/bin/$n --test-threads=1 --nocapture > $O/t/test-$n.log 2>&1
  echo "test $n: exit $? in $(( $(date +%s) - t0 )) s: $(grep '^test result' $O/t/test-$n.log | tail -1)"; grep -h "FAILED\|panicked" $O/t/test-$n.log | head -5; done
grep -h "MEASURED\|measured" $O/t/test-*.log | head -20
timeout 150 /tmp/bin/gpu --ignored --nocapture --test-threads=1 --exact bench_moe_prompt > $O/t/micro-moe.log 2>&1; grep "^bench" $O/t/micro-moe.log
timeout 150 /tmp/bin/matmul --ignored --nocapture --test-threads=1 --exact bench_matmul_prompt > $O/t/micro-matmul.log 2>&1; grep "^bench prompt matmul" $O/t/micro-matmul.log
(cd $O && tar czf t.tgz t && rm -rf t)
wait $SY; echo "synth: $?"
while [[ -f $L/building ]]; do sleep 2; done; echo "llama.cpp built: $(cat $L/built) at $SECONDS s; ud synth: $(ls -la /tmp/m/ | grep -c 35b-ud.gguf$)"
mkdir -p $O/ab8; OUT=$O/ab8 LLAMA=0 STAGES=ab ROUNDS=2 AB=EMBER_MOE_MMA8=0 AB_ARGS="-p 512,2048,8192 -n 0" ./bench/gpu/h200.sh 2>&1 | grep "^ab"
mkdir -p $O/abd; OUT=$O/abd LLAMA=0 STAGES=ab ROUNDS=2 AB=EMBER_MMA8=0 AB_ARGS="-p 512,2048,8192 -n 0" ./bench/gpu/h200.sh 2>&1 | grep "^ab"
(cd $O && tar czf ab.tgz ab8 abd && rm -rf ab8 abd)
echo "done at $SECONDS s"
