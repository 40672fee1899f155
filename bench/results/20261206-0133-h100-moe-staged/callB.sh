#!/usr/bin/env bash
# Call B (warm after A): issue 19's table, ember against llama.cpp (built in call A), one round.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/w
OUT=$O/w ROUNDS=1 PROMPTS=512,8192 DEPTHS=8192,32768 STAGES=bench,batched ./bench/gpu/h200.sh
(cd $O && tar czf w.tgz w && rm -rf w)
echo "done at $SECONDS s"
