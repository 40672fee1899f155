#!/usr/bin/env bash
# Call I (main 7ad9038): every GPU test binary + serve-check (h200.sh tests,serve; the q4_k_m and
# ud-q4_k_m 35Bs synthesised meanwhile), then the test binaries that reach the switched kernels
# with all three switches on, then issue 20's pressure test on the ud 35B.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/i/sw
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $O/i/gpu.txt
OUT=$O/i LLAMA=0 UD_SYNTH=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
export EMBER_KERNEL_CACHE=/tmp/kc EMBER_KERNEL_DEFINES=EMBER_NORM_W_EARLY,EMBER_GEMV_W_EARLY,EMBER_MOE_DOWN_W_EARLY
sw() { local n=$1 t0=$SECONDS; timeout 240 /tmp/bin/$n --test-threads=1 --nocapture > $O/i/sw/test-$n.log 2>&1
  echo "switched test $n: exit $? in $((SECONDS-t0)) s: $(grep '^test result' $O/i/sw/test-$n.log | tail -1)"; }
sw gemv_q8 & A=$!
for n in gpu conformance model hybrid; do sw $n; done
wait $A
unset EMBER_KERNEL_DEFINES
echo "switched tests done at $SECONDS s"
(cd $O && tar czf i.tgz i)
OUT=$O/i STEP_S=5 STAGES=pressure ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && tar czf i.tgz i && rm -rf i)
