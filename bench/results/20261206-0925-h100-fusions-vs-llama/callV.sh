#!/usr/bin/env bash
# Call V: every GPU test binary + serve-check with the L2 hint (Ops::prefetch: the next layer's
# first projections asked for in L2 by the MoE's down) on by default (llama.cpp builds
# meanwhile); tg128 A/B (3 rounds in turn): all on / hint off / hint, mixed GEMV and fused prep
# off; the trace with all on; then issue 19's table (ember against llama.cpp, one round) with
# whichever of on / hint off had the higher A/B mean.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/v
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $O/v/gpu.txt
OUT=$O/v SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
OUT=$O/v LLAMA=0 STAGES=variants ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS='on:;nopf:EMBER_PREFETCH_NEXT=0;none:EMBER_PREFETCH_NEXT=0 EMBER_GEMV_MIXED=0 EMBER_DELTA_PREP_FUSED=0' ./bench/gpu/h200.sh
echo "variants done at $SECONDS s"
EMBER_KERNEL_CACHE=/tmp/kc EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/v/tr-tg64.txt timeout 100 /tmp/bin/ember bench -m /tmp/m/35b.gguf --device cuda -p 0 -n 64 -r 1 > $O/v/tr-tg64.log 2>&1
python3 bench/gpu/trace.py $O/v/tr-tg64.txt > $O/v/tr-tg64.md 2>&1; head -30 $O/v/tr-tg64.md; xz -T4 $O/v/tr-tg64.txt
best=$(python3 -c "
import json,glob,statistics as st
m={v: st.mean(json.load(open(f))[0]['avg_ts'] for f in glob.glob('$O/v/variant-%s-*.json' % v)) for v in ('on','nopf')}
print('on' if m['on'] >= m['nopf'] else 'nopf')" 2>/dev/null || echo on)
echo "table with: $best at $SECONDS s"
(cd $O && tar czf v.tgz v)
[[ $best == nopf ]] && export EMBER_PREFETCH_NEXT=0
OUT=$O/v ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench,batched ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && rm -f v.tgz && tar czf v.tgz v && rm -rf v)
