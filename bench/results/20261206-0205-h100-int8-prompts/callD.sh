#!/usr/bin/env bash
# Call D (main + the staged int8 down + the dense int8 matmul): the MoE and matmul tests and
# microbenchmarks, prompts with the new kernels against the old and at other pair bounds,
# pp512's kernel profile, then issue 19's rows against llama.cpp (built in the background).
set -uo pipefail
O=${OUT:?}; mkdir -p $O/w
OUT=$O/w STAGES=tests SKIP_TESTS=gemv_q8,attention,nvrtc_compile,top_k,delta_rule,mailbox,transfers,upload,graph ./bench/gpu/h200.sh
grep -h "MOE_MMA_MEASURED.*Staged" $O/w/test-gpu.log | head -8; grep -h "MATMUL_MMA8_MEASURED" $O/w/test-matmul.log | head -6
grep -h "panicked" -A3 $O/w/test-*.log | head -20
OUT=$O/w STAGES=micro MICRO=gpu:bench_moe_prompt,matmul:bench_matmul_prompt ./bench/gpu/h200.sh
export EMBER_KERNEL_CACHE=/tmp/kc; E=/tmp/bin/ember; F=/tmp/m/35b.gguf
sum() { python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$1" 2>/dev/null; }
pp() { local tag=$1; shift; env "$@" timeout 150 $E bench -m $F --device cuda -p 512,2048,8192 -n 0 -r 2 -o json > $O/w/$tag.json 2> $O/w/$tag.log
  echo "$tag: exit $? $(sum $O/w/$tag.json) $(grep -m1 -i 'error' $O/w/$tag.log) at $SECONDS s"; }
OLD=(EMBER_MOE_MMA8_STAGED=0 EMBER_MATMUL_MMA8=0)
pp new-1; pp old-1 "${OLD[@]}"; pp mm8off-1 EMBER_MATMUL_MMA8=0; pp down64-1 EMBER_MOE_MMA8_DOWN_MAX_PAIRS=64
pp all256-1 EMBER_MOE_MMA8_MAX_PAIRS=256 EMBER_MOE_MMA8_DOWN_MAX_PAIRS=256; pp new-2; pp old-2 "${OLD[@]}"
EMBER_CUDA_PROFILE=1 timeout 60 $E bench -m $F --device cuda -p 512 -n 0 -r 1 > $O/w/kprofile-pp512.txt 2>&1; grep -A14 "GPU time per kernel" $O/w/kprofile-pp512.txt
(cd $O && tar czf w.tgz w)
if [[ $SECONDS -lt ${LLAMA_BY:-430} ]]; then
  OUT=$O/w ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench ./bench/gpu/h200.sh
else echo "no time left for llama.cpp ($SECONDS s)"; fi
(cd $O && tar czf w.tgz w && rm -rf w)
echo "done at $SECONDS s"
