#!/usr/bin/env bash
# Call N: the int8 prompt kernels with a sub-block's mmas issued together and only the MoE
# tiles that hold pairs (9eb124c -> the commit after it). The GPU tests that cover them (gpu:
# staged = unstaged bits and the reference; matmul; conformance; model; hybrid) while llama.cpp
# builds and the 35B is written, attention's tiles test printing its errors (attention_mma's
# lean form); bench_moe_prompt and bench_matmul_prompt; ember new / old (9eb124c) alternating,
# pp512, pp2048, pp8192; ncu of the new prompt kernels; issue 19's table against llama.cpp.
set -uo pipefail
O=${OUT:?}/n; mkdir -p $O
tar -C /tmp -xJf .gpu/n.tar.xz  # bin/ (ember and the test binaries) and old/ember (9eb124c)
export EMBER_KERNEL_CACHE=/tmp/kc
timeout 200 /tmp/bin/attention --test-threads=1 --nocapture tiles_match_the_reference > $O/attention-tiles.log 2>&1 &
OUT=$O LLAMA=1 SKIP_TESTS=attention,delta_rule,gemv_q8,graph,mailbox,references,split,top_k,transfers,upload TESTS_BESIDE=gpu,conformance STAGES=tests ./bench/gpu/h200.sh
echo "tests done at $SECONDS s"
for f in "gpu bench_moe_prompt" "matmul bench_matmul_prompt"; do set -- $f
  timeout 90 /tmp/bin/$1 --ignored --test-threads=1 --nocapture --exact $2 > $O/micro-$2.log 2>&1; echo "micro $2: exit $?"; grep -vE '^$|^running|^test result' $O/micro-$2.log | head -20
done
echo "micro done at $SECONDS s"
F=/tmp/m/35b.gguf
for r in 1 2; do
  for v in new old; do
    (( SECONDS > 330 )) && break 2
    B=/tmp/bin/ember; [[ $v == old ]] && B=/tmp/old/ember
    timeout 60 $B bench -m $F --device cuda -p 512,2048,8192 -n 0 -r 2 -o json > $O/ab-$v-$r.json 2> $O/ab-$v-$r.log
    echo "ab $v round $r: exit $? $(python3 -c "import json,sys; print([(x['n_prompt'], round(x['avg_ts'],1)) for x in json.load(open(sys.argv[1]))])" $O/ab-$v-$r.json 2>/dev/null)"
  done
done
echo "ab done at $SECONDS s"
if (( SECONDS < 300 )); then
  OUT=$O NCU_COUNT=8 NCU_RUNS='pp512:moe_mma8s|matmul_mma8s:-p 512 -n 0' STAGES=ncu timeout $(( 380 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | tail -40
fi
echo "ncu done at $SECONDS s"
wait
grep -E "max rel|tiles vs" $O/attention-tiles.log | tail -20
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( 575 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf n.tgz n && rm -rf n)
