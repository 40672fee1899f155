#!/usr/bin/env bash
# Call C (warm): issue 18 on the 16-core host: ember against llama.cpp on the CPU at 16 and 8
# threads, depths 0 and 4096.
set -uo pipefail
R=${OUT:?}; O=/tmp/oC; mkdir -p $O; export OUT=$O
STAGES=cpu ROUNDS=1 CPU_REPS=1 CPU_THREADS=16,8 CPU_DEPTHS=4096 CPU_HTTP=0 CPU_PROFILE=0 ./bench/gpu/h200.sh
tar -C /tmp -czf $R/oC.tgz oC
