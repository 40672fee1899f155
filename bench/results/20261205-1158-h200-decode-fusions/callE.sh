#!/usr/bin/env bash
# Call E: the delta_decode kernel split over 8 blocks a key head (tickets): its tests, its
# microbenchmark, the in-model A/B.
set -uo pipefail
R=${OUT:?}; O=/tmp/oE; mkdir -p $O; export OUT=$O
LLAMA=0 STAGES=tests SKIP_TESTS=attention,gemv_q8,mailbox,nvrtc_compile,transfers,upload,ember_plan ./bench/gpu/h200.sh
grep -E "bit for bit" $O/test-delta_rule.log | tail -10
timeout 60 /tmp/bin/delta_rule --ignored --nocapture --test-threads=1 bench_delta_decode > $O/bench-delta-decode.log 2>&1; echo "bench delta_decode: exit $?"
grep "bench delta_decode" $O/bench-delta-decode.log
LLAMA=0 STAGES=ab ROUNDS=2 AB=EMBER_DELTA_FUSED=0 AB_ARGS="-p 0 -n 128 -d 0,4096" ./bench/gpu/h200.sh
tar -C /tmp -czf $R/oE.tgz oE
