#!/usr/bin/env bash
# g27's second call (~560 s, fresh machine): the test binaries that read the BF16 fixture (the
# first call ran without it) and the ones the Q8Unit load / dot split and the early residual
# loads touch, with llama.cpp building beside; the norm-in test at 128 and 512 threads; then tg128
# under EMBER_NORM_IN=0 / router / all (256, 128, 512 threads; all with 256 threads a SM of
# workers), ROUNDS rounds in turn once the build is done, and the default's launch trace.
set -uo pipefail
L=${LIMIT:-570}
O=${OUT:?}/r; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
OUT=$O LLAMA=${LLAMA:-1} TESTS_BESIDE=gemv_q8 STAGES=tests ./bench/gpu/h200.sh
echo "tests done at $SECONDS s"
for v in EMBER_NORM_IN_THREADS=128 EMBER_NORM_IN_THREADS=512; do
  env $v timeout 100 /tmp/bin/gemv_q8 --test-threads=1 --nocapture --exact norm_in_matches_the_norm_launch > "$O/test-${v#EMBER_}.log" 2>&1
  echo "$v: $(grep -E '^(norm_in|test result)' "$O/test-${v#EMBER_}.log" | tr '\n' ' ')"
done
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 250 )); do sleep 2; done
echo "llama.cpp build: $(cat /tmp/llama/built 2>/dev/null || echo running) at $SECONDS s"
(( SECONDS < L - 120 )) && OUT=$O ROUNDS=${ROUNDS:-2} VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS='off:EMBER_NORM_IN=0;router:EMBER_NORM_IN=router;all:;all128:EMBER_NORM_IN_THREADS=128;all512:EMBER_NORM_IN_THREADS=512;fill256:EMBER_NORM_IN_FILL=256' STAGES=variants \
  timeout $(( L - 45 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
if (( SECONDS < L - 40 )); then
  EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-all.txt timeout 35 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-all.json 2> $O/tr-all.log
  python3 bench/gpu/trace.py $O/tr-all.txt > $O/tr-all.md 2>&1; sed -n 1,26p $O/tr-all.md
  xz -T4 $O/tr-*.txt 2>/dev/null
fi
echo "done at $SECONDS s"
(cd ${OUT} && tar czf r.tgz r && rm -rf r)
