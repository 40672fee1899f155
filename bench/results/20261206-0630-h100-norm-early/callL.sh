#!/usr/bin/env bash
# Call L: every GPU test binary + serve-check with the norm's register form on by default
# (llama.cpp builds meanwhile), the delta-rule switch's tests, then its A/B on decode.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/l/sw
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $O/l/gpu.txt
OUT=$O/l SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
export EMBER_KERNEL_CACHE=/tmp/kc
sw() { local n=$1 t0=$SECONDS; EMBER_KERNEL_DEFINES=EMBER_DELTA_S_EARLY timeout 240 /tmp/bin/$n --test-threads=1 --nocapture > $O/l/sw/test-$n.log 2>&1
  echo "switched test $n: exit $? in $((SECONDS-t0)) s: $(grep '^test result' $O/l/sw/test-$n.log | tail -1)"; }
for n in delta_rule model hybrid; do sw $n; done
(cd $O && tar czf l.tgz l)
OUT=$O/l LLAMA=0 STAGES=variants ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' VARIANTS='plain:;delta:EMBER_KERNEL_DEFINES=EMBER_DELTA_S_EARLY' ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && tar czf l.tgz l && rm -rf l)
