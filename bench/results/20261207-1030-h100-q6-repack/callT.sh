#!/usr/bin/env bash
# The Q6_K repack's first device call (~570 s, fresh machine; pack with PACK_SKIP=nvrtc_compile,
# bandwidth,model_bench and the vocabulary moved out, the BF16 fixture kept: the GPU tests read
# it): every GPU test binary at the defaults with llama.cpp building beside, then the binaries
# that read Q6_K with EMBER_KERNEL_DEFINES=EMBER_Q6_REPACK (kernels and uploads repacked), then
# tg128 and pp512 with and without it, ROUNDS rounds in turn once the build is done.
set -uo pipefail
L=${LIMIT:-570}
O=${OUT:?}/t; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=${LLAMA:-1} SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
for t in gemv_q8 conformance model gpu matmul hybrid graph references split; do
  EMBER_KERNEL_DEFINES=EMBER_Q6_REPACK timeout 300 /tmp/bin/$t --test-threads=1 > "$O/test-$t-q6r.log" 2>&1
  echo "EMBER_Q6_REPACK $t: exit $? at $SECONDS s: $(grep -E '^test result' "$O/test-$t-q6r.log" | tail -1)"
done
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 200 )); do sleep 2; done
(( SECONDS < L - 120 )) && OUT=$O ROUNDS=${ROUNDS:-2} VARIANT_ARGS='-p 512 -n 128' \
  VARIANTS='file:;q6r:EMBER_KERNEL_DEFINES=EMBER_Q6_REPACK' STAGES=variants \
  timeout $(( L - 15 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
(cd ${OUT} && tar czf t.tgz t && rm -rf t)
