#!/usr/bin/env bash
# Call B (warm, after A): ember against llama.cpp CUDA on the same file, alternating: pp512,
# pp8192, tg128 at depths 0 and 32768; then 16 sequences at depth 4096.
set -uo pipefail
R=${OUT:?}; O=/tmp/oB; mkdir -p $O; export OUT=$O
STAGES=bench ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 ./bench/gpu/h200.sh
STAGES=batched ROUNDS=1 ./bench/gpu/h200.sh
tar -C /tmp -czf $R/oB.tgz oB
