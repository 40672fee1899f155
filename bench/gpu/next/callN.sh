#!/usr/bin/env bash
# The tree's defaults on a fresh machine, ~200 s (for a session's last device minutes): the GPU
# test binaries that run attention or the model (attention, model, conformance, gpu, hybrid,
# graph, delta_rule, gemv_q8) side by side, serve-check, then bench_attention_decode_mma (with
# one and four deep rows at 128 and 256 ranges a row).
set -uo pipefail
O=${OUT:?}/n; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
T=(attention model conformance gpu hybrid graph delta_rule gemv_q8)
P=()
for t in "${T[@]}"; do
  timeout 150 /tmp/bin/$t --test-threads=1 --nocapture > $O/test-$t.log 2>&1 &
  P+=($!)
done
wait "${P[@]}"
for t in "${T[@]}"; do echo "$t: $(grep -E '^test result' $O/test-$t.log | tail -1)"; done
grep -h "decode on tensor cores vs\|decode vs reference" $O/test-attention.log
timeout 40 python3 bench/gpu/serve-check.py /tmp/bin/ember > $O/serve-check.log 2>&1; echo "serve-check: exit $? at $SECONDS s"
timeout 60 /tmp/bin/attention --ignored --test-threads=1 --nocapture --exact bench_attention_decode_mma > $O/micro-adm.log 2>&1
echo "micro: exit $?"; grep -E '^decode mma' $O/micro-adm.log | sed 's/^decode mma //' | grep -E "depth (8192|32768)"
(cd ${OUT} && tar czf n.tgz n && rm -rf n)
