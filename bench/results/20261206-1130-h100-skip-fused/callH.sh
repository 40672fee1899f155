#!/usr/bin/env bash
# Call H: bench/gpu/chain-micro.cu: what one link of a chain of dependent kernels costs by how a
# kernel waits (plain graph edges, programmatic launch, a release/acquire counter).
set -uo pipefail
O=${OUT:?}/h; mkdir -p $O
nvcc -O3 -std=c++17 -arch=sm_90 bench/gpu/chain-micro.cu -o /tmp/chain-micro > $O/nvcc.log 2>&1; echo "nvcc: exit $? at $SECONDS s"; tail -5 $O/nvcc.log
timeout 60 /tmp/chain-micro 2>&1 | tee $O/chain-micro.txt
echo "done at $SECONDS s"
