#!/usr/bin/env bash
# Call P (main 17994fd): every GPU test binary (switches included) + serve-check; llama.cpp
# builds meanwhile in its own session and the q4_k_m 35B is synthesised, both for later calls.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/p
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $O/p/gpu.txt
OUT=$O/p SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "done at $SECONDS s"
(cd $O && tar czf p.tgz p && rm -rf p)
