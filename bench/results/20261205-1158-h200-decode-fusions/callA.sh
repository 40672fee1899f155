#!/usr/bin/env bash
# Call A: GPU tests of the fused DeltaNet decode core and the routing in gate/up, their
# microbenchmark, in-model A/B of each switch; llama.cpp builds alongside for call B.
set -uo pipefail
R=${OUT:?}; O=/tmp/oA; mkdir -p $O; export OUT=$O
nproc; lscpu | grep -E "Model name" | head -1
STAGES=tests SKIP_TESTS=mailbox,nvrtc_compile,transfers,upload,ember_plan ./bench/gpu/h200.sh
grep -E "bit for bit|routed in gate/up|moe_q8:" $O/test-delta_rule.log $O/test-gemv_q8.log | tail -12
timeout 60 /tmp/bin/delta_rule --ignored --nocapture --test-threads=1 bench_delta_decode > $O/bench-delta-decode.log 2>&1; echo "bench delta_decode: exit $?"
grep "bench delta_decode" $O/bench-delta-decode.log
for sw in EMBER_DELTA_FUSED EMBER_ROUTE_FUSED; do
    STAGES=ab ROUNDS=2 AB=$sw=0 AB_ARGS="-p 0 -n 128 -d 0,4096" ./bench/gpu/h200.sh
    mkdir -p $O/ab-$sw && mv $O/ab-*.json $O/ab-*.log $O/ab-$sw/ 2>/dev/null
done
ls /tmp/llama/build/bin 2>/dev/null | head -3; cat /tmp/llama/built 2>/dev/null
tar -C /tmp -czf $R/oA.tgz oA
