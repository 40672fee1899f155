#!/usr/bin/env bash
# Call B: the route's L2 prefetch of its chosen experts (EMBER_ROUTE_PREFETCH: gu, the default
# here; 0; all) and Q6_K's wide loads (kernel define EMBER_Q6_WIDE): every GPU test + serve-check
# with the defaults, the int8/MoE/model tests again with the define; greedy text of the 35B
# under each (must be the same); tg128 A/B, three rounds; a traced tg64 with and without the
# prefetch.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/b
OUT=$O/b LLAMA=0 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
export EMBER_KERNEL_CACHE=/tmp/kc
for t in gemv_q8 gpu model conformance hybrid; do
  EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE timeout 200 /tmp/bin/$t --test-threads=1 > $O/b/q6-test-$t.log 2>&1
  echo "q6 test $t: exit $? $(grep '^test result' $O/b/q6-test-$t.log | tail -1)"
done
for t in model conformance hybrid; do
  EMBER_ROUTE_PREFETCH=all timeout 200 /tmp/bin/$t --test-threads=1 > $O/b/pfall-test-$t.log 2>&1
  echo "pfall test $t: exit $? $(grep '^test result' $O/b/pfall-test-$t.log | tail -1)"
done
echo "at $SECONDS s"
P="The history of the printing press begins"
for v in "base:" "pf0:EMBER_ROUTE_PREFETCH=0" "pfall:EMBER_ROUTE_PREFETCH=all" "q6:EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE"; do
  n=${v%%:*}; envs=(${v#*:})
  env "${envs[@]}" timeout 120 /tmp/bin/ember run -m /tmp/m/35b.gguf --device cuda -p "$P" -n 48 --temp 0 --ignore-eos > $O/b/run-$n.txt 2> $O/b/run-$n.log
  echo "run $n: exit $? $(md5sum < $O/b/run-$n.txt)"
done
V='base:;pf0:EMBER_ROUTE_PREFETCH=0;pfall:EMBER_ROUTE_PREFETCH=all;q6:EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE;q6all:EMBER_KERNEL_DEFINES=EMBER_Q6_WIDE EMBER_ROUTE_PREFETCH=all'
OUT=$O/b STAGES=variants ROUNDS=3 VARIANT_ARGS='-p 0 -n 128' VARIANTS="$V" ./bench/gpu/h200.sh 2>&1 | grep variant
echo "at $SECONDS s"
for v in "base:" "pf0:EMBER_ROUTE_PREFETCH=0"; do
  n=${v%%:*}; envs=(${v#*:})
  env "${envs[@]}" EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/b/trace-$n.txt timeout 100 /tmp/bin/ember bench -m /tmp/m/35b.gguf --device cuda -p 0 -n 64 -r 1 > $O/b/trace-$n.log 2>&1
  python3 bench/gpu/trace.py $O/b/trace-$n.txt > $O/b/trace-$n.md 2>&1; echo "trace $n: exit $?"; head -30 $O/b/trace-$n.md
done
echo "done at $SECONDS s"
(cd $O && tar czf b.tgz b && rm -rf b)
