#!/usr/bin/env bash
# Call A: every GPU test binary + serve-check at 25058f1 (the defaults), then model, hybrid and
# serve-check again with EMBER_STEP_UPLOAD_SKIP=1 (and model/delta_rule's fused-prep checks are
# part of the defaults' run); then tg128 and 16 sequences @ d4096 under off / fused / skip / both.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/a
OUT=$O/a LLAMA=0 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
export EMBER_KERNEL_CACHE=/tmp/kc
for t in model hybrid; do
  EMBER_STEP_UPLOAD_SKIP=1 timeout 200 /tmp/bin/$t --test-threads=1 > $O/a/skip-test-$t.log 2>&1
  echo "skip test $t: exit $? $(grep '^test result' $O/a/skip-test-$t.log | tail -1)"
done
EMBER_STEP_UPLOAD_SKIP=1 timeout 200 python3 bench/gpu/serve-check.py /tmp/bin/ember > $O/a/skip-serve-check.log 2>&1
echo "skip serve-check: exit $?"; grep -cE '^ok' $O/a/skip-serve-check.log; grep -E '^FAIL' $O/a/skip-serve-check.log
echo "at $SECONDS s"
V='off:;fused:EMBER_DELTA_PREP_FUSED=1;skip:EMBER_STEP_UPLOAD_SKIP=1;both:EMBER_DELTA_PREP_FUSED=1 EMBER_STEP_UPLOAD_SKIP=1'
OUT=$O/a STAGES=variants ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' VARIANTS="$V" ./bench/gpu/h200.sh 2>&1 | grep variant
echo "at $SECONDS s"
mkdir -p $O/a/b16
OUT=$O/a/b16 STAGES=variants ROUNDS=2 VARIANT_ARGS='--n-seq 16 -p 0 -n 128 -d 4096' VARIANTS="$V" ./bench/gpu/h200.sh 2>&1 | grep variant
echo "done at $SECONDS s"
(cd $O && tar czf a.tgz a && rm -rf a)
