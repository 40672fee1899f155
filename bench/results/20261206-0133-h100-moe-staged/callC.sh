#!/usr/bin/env bash
# Call C (warm after B): issue 18 on this host's CPU (GPU hidden) against llama.cpp, 16 and 8
# threads, depths 0 and 4096, then the per-op profile at 16 threads and the HTTP path.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/w
OUT=$O/w ROUNDS=1 CPU_REPS=1 STAGES=cpu ./bench/gpu/h200.sh
(cd $O && tar czf w.tgz w && rm -rf w)
echo "done at $SECONDS s"
