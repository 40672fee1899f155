#!/usr/bin/env bash
# Call M: issue 19's table again, ember against llama.cpp (built in call L), one round.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/m
OUT=$O/m ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench,batched ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && tar czf m.tgz m && rm -rf m)
