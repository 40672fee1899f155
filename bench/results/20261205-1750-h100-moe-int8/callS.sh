#!/usr/bin/env bash
# Call S (same warm machine; llama.cpp built in call Q): issue 19's table, both engines.
set -uo pipefail
O=${OUT:?}; export OUT=$O; export EMBER_KERNEL_CACHE=/tmp/kc
mkdir -p $O/b; OUT=$O/b ROUNDS=1 PROMPTS=512,8192 DEPTHS=8192,32768 STAGES=bench,batched ./bench/gpu/h200.sh 2>&1 | tail -16
(cd $O && tar czf b.tgz b && rm -rf b)
echo "done at $SECONDS s"
