#!/usr/bin/env bash
# Call K: the decode attention's `_pf` entries (rows loaded ahead, taken from 256-key ranges)
# and 4 heads a block at most without them. The GPU tests that cover attention (attention with
# F32/F16/Q8_0 ranges, conformance, graph, hybrid, model, references, split) while llama.cpp
# b11434 builds and the 35B is written; the decode kernel's microbenchmark; then issue 19's
# table against llama.cpp (pp512, pp8192, tg128 at depth 0 and 32768; 16 sequences at depth
# 4096), one round; then ember new / old (7e40934) alternating: tg128 at depth 0 and 32768,
# 16 sequences at depth 4096.
set -uo pipefail
O=${OUT:?}/k; mkdir -p $O
tar -C /tmp -xJf .gpu/k.tar.xz  # bin/ (ember and seven test binaries) and old/ember (7e40934)
export EMBER_KERNEL_CACHE=/tmp/kc
OUT=$O LLAMA=1 STAGES=tests ./bench/gpu/h200.sh
echo "tests done at $SECONDS s"
EMBER_KERNEL_DEFINES= timeout 120 /tmp/bin/attention --ignored --test-threads=1 --nocapture bench_attention_decode_heads > $O/micro-dec.log 2>&1
echo "micro: exit $?"; grep -E '^decode heads' $O/micro-dec.log
echo "micro done at $SECONDS s"
OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( 470 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
OUT=$O ROUNDS=1 STAGES=batched timeout $(( 520 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "batched done at $SECONDS s"
F=/tmp/m/35b.gguf
for r in 1 2 3; do
  for v in new old; do
    (( SECONDS > 515 )) && break 2
    B=/tmp/bin/ember; [[ $v == old ]] && B=/tmp/old/ember
    timeout 30 $B bench -m $F --device cuda -p 0 -n 128 -d 0,32768 -r 2 -o json > $O/ab-$v-$r.json 2> $O/ab-$v-$r.log
    echo "ab $v round $r: exit $? $(python3 -c "import json,sys; print([(x['n_depth'], round(x['avg_ts'],1)) for x in json.load(open(sys.argv[1]))])" $O/ab-$v-$r.json 2>/dev/null)"
    timeout 40 $B bench -m $F --device cuda -p 0 -n 128 -d 4096 --n-seq 16 -r 2 -o json > $O/ab16-$v-$r.json 2> $O/ab16-$v-$r.log
    echo "ab16 $v round $r: exit $? $(python3 -c "import json,sys; print([(x['name'], round(x['avg_ts'],1)) for x in json.load(open(sys.argv[1]))])" $O/ab16-$v-$r.json 2>/dev/null)"
  done
done
echo "done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf k.tgz k && rm -rf k)
