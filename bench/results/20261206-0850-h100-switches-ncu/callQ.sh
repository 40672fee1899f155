#!/usr/bin/env bash
# Call Q (main 17994fd): bench/gpu/switches-ab.sh (bits, tg128 A/B on a 16-layer cut, the
# switched tests).
set -uo pipefail
O=${OUT:?}; mkdir -p $O/q
OUT=$O/q ROUNDS=${ROUNDS:-2} bash bench/gpu/switches-ab.sh
echo "done at $SECONDS s"
(cd $O && tar czf q.tgz q && rm -rf q)
