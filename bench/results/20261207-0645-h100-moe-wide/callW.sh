#!/usr/bin/env bash
# The one-token MoE's two changes (docs/perf.md g26): the warp-per-row gate/up
# (moe_gate_up_q8w, EMBER_MOE_GU_WIDE) and down's weights loaded before its wait
# (EMBER_MOE_DOWN_PRELOAD), both off by default until measured. First call on a fresh machine
# (~480 s): every GPU test binary and serve-check with both on, llama.cpp building beside them,
# bench_moe_q8 (the MoE alone under each), tg128 in turn under: old (both off, the defaults),
# new (both on), w1 / w2 (1 or 2 rows a warp forced), gu (gate/up only), dp (down only), ROUNDS
# rounds; the in-GPU launch trace of tg64 old and new (bench/gpu/trace.py); then issue 19's
# table (callH.sh's) if llama.cpp is built by then.
set -uo pipefail
L=${LIMIT:-585}
O=${OUT:?}/w; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz; E=/tmp/bin/ember; F=/tmp/m/35b.gguf
# The tests with both changes on (gemv_q8's MoE test runs every form itself).
EMBER_MOE_GU_WIDE=auto EMBER_MOE_DOWN_PRELOAD=1 OUT=$O LLAMA=${LLAMA:-1} SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
timeout 90 /tmp/bin/gemv_q8 --ignored --test-threads=1 --nocapture --exact bench_moe_q8 > $O/micro-moe.log 2>&1
echo "micro: exit $?"; grep -E '^bench moe' $O/micro-moe.log
OUT=$O ROUNDS=${ROUNDS:-2} VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS='old:;new:EMBER_MOE_GU_WIDE=auto EMBER_MOE_DOWN_PRELOAD=1;w1:EMBER_MOE_GU_WIDE=1 EMBER_MOE_DOWN_PRELOAD=1;w2:EMBER_MOE_GU_WIDE=2 EMBER_MOE_DOWN_PRELOAD=1;gu:EMBER_MOE_GU_WIDE=auto;dp:EMBER_MOE_DOWN_PRELOAD=1' STAGES=variants \
  timeout $(( L - 90 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
T=(EMBER_KERNEL_DEFINES=EMBER_TRACE)
for v in old:0:0 new:auto:1; do
  IFS=: read -r n m pre <<< "$v"
  (( SECONDS < L - 40 )) || break
  env "${T[@]}" EMBER_CUDA_TRACE=$O/tr-$n.txt EMBER_MOE_GU_WIDE=$m EMBER_MOE_DOWN_PRELOAD=$pre timeout 60 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-$n.json 2> $O/tr-$n.log
  echo "trace $n: exit $? at $SECONDS s"
  python3 bench/gpu/trace.py $O/tr-$n.txt > $O/tr-$n.md 2>&1; head -30 $O/tr-$n.md
done
xz -T4 $O/tr-*.txt 2>/dev/null
# Issue 19's table with both on, if llama.cpp is built and time is left (callH.sh's).
export EMBER_MOE_GU_WIDE=auto EMBER_MOE_DOWN_PRELOAD=1
if (( SECONDS < L - 100 )) && [[ -x /tmp/llama/build/bin/llama-bench ]]; then
  OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout $(( L - 45 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
  echo "bench done at $SECONDS s"
  (( SECONDS < L - 35 )) && OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout $(( L - 10 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
fi
echo "done at $SECONDS s"
(cd ${OUT} && tar czf w.tgz w && rm -rf w)
