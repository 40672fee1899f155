#!/usr/bin/env bash
# g27's first call (~560 s, fresh machine): every GPU test binary and serve-check at the tree's
# defaults (the norms folded into the projections that read them, 256-thread blocks; llama.cpp
# builds beside), the norm-in test at 128 and 512 threads a block and conformance / model with
# the fold off (EMBER_NORM_IN=0), then tg128 with the fold off / on at 128, 256 and 512 threads,
# ROUNDS rounds in turn once the build is done, and the launch trace of the default.
set -uo pipefail
L=${LIMIT:-570}
O=${OUT:?}/q; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember; F=/tmp/m/35b.gguf
OUT=$O LLAMA=${LLAMA:-1} SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
for v in EMBER_NORM_IN_THREADS=128 EMBER_NORM_IN_THREADS=512; do
  env $v timeout 100 /tmp/bin/gemv_q8 --test-threads=1 --nocapture --exact norm_in_matches_the_norm_launch > "$O/test-${v#EMBER_}.log" 2>&1
  echo "$v: $(grep -E '^(norm_in|test result)' "$O/test-${v#EMBER_}.log" | tr '\n' ' ')"
done
for t in conformance model; do
  EMBER_NORM_IN=0 timeout 200 /tmp/bin/$t --test-threads=1 > "$O/test-$t-norm-in-off.log" 2>&1
  echo "EMBER_NORM_IN=0 $t: exit $? $(grep -E '^test result' "$O/test-$t-norm-in-off.log")"
done
echo "extra tests done at $SECONDS s"
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 200 )); do sleep 2; done
echo "llama.cpp build: $(cat /tmp/llama/built 2>/dev/null || echo running) at $SECONDS s"
(( SECONDS < L - 120 )) && OUT=$O ROUNDS=${ROUNDS:-2} VARIANT_ARGS='-p 0 -n 128' \
  VARIANTS='off:EMBER_NORM_IN=0;t256:;t128:EMBER_NORM_IN_THREADS=128;t512:EMBER_NORM_IN_THREADS=512' STAGES=variants \
  timeout $(( L - 45 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
if (( SECONDS < L - 30 )); then
  EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-new.txt timeout 25 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-new.json 2> $O/tr-new.log
  python3 bench/gpu/trace.py $O/tr-new.txt > $O/tr-new.md 2>&1; sed -n 1,30p $O/tr-new.md
  xz -T4 $O/tr-*.txt 2>/dev/null
fi
echo "done at $SECONDS s"
(cd ${OUT} && tar czf q.tgz q && rm -rf q)
