#!/usr/bin/env bash
# Call C: every GPU test + serve-check at the final tree (the fused prep and the upload skip
# removed), while llama.cpp b11434 builds; then issue 19's table against it (tg128 and pp512 at
# depth 0 and 32768, one round) with the two new switches on (EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE,
# EMBER_TOPK_CHUNK=2048); then their A/B on tg128, three rounds, nothing else running.
set -uo pipefail
O=${OUT:?}/c; mkdir -p $O
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
export EMBER_KERNEL_CACHE=/tmp/kc
EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE EMBER_TOPK_CHUNK=2048 OUT=$O ROUNDS=1 PROMPTS=512 DEPTHS=32768 STAGES=bench \
  timeout $(( 470 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | tail -20
echo "bench done at $SECONDS s"
V='base:;q6:EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE;tk2:EMBER_TOPK_CHUNK=2048;both:EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE EMBER_TOPK_CHUNK=2048'
for r in 1 2 3; do
  (( SECONDS > 545 )) && break
  IFS=';' read -ra VS <<< "$V"
  for v in "${VS[@]}"; do
    name=${v%%:*}; envs=(${v#*:})
    env "${envs[@]}" timeout 40 /tmp/bin/ember bench -m /tmp/m/35b.gguf --device cuda -p 0 -n 128 -r 2 -o json > $O/variant-$name-$r.json 2> $O/variant-$name-$r.log
    echo "variant $name round $r: exit $? $(python3 -c "import json,sys; print([round(x['avg_ts'],1) for x in json.load(open(sys.argv[1]))])" $O/variant-$name-$r.json 2>/dev/null)"
  done
done
echo "done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf c.tgz c && rm -rf c)
