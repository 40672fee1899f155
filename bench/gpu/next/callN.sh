#!/usr/bin/env bash
# Session 2026-12-07's check of the new default (attention_decode_mma on, 2 warps at head_dim
# 256) on a fresh machine, ~220 s: the GPU test binaries that run attention (attention, model,
# conformance, gpu, hybrid, graph) beside `ember synth`, serve-check, then ember's tg128 at depth
# 0 and 32768 with the defaults and with EMBER_ATTN_DECODE_MMA=0 (one round each).
set -uo pipefail
L=${LIMIT:-240}
O=${OUT:?}/n; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
mkdir -p /tmp/m
( /tmp/bin/ember synth -o /tmp/m/35b.gguf.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv /tmp/m/35b.gguf.tmp /tmp/m/35b.gguf ) &
SY=$!
P=()
for t in attention model conformance gpu hybrid graph; do
  timeout 170 /tmp/bin/$t --test-threads=1 --nocapture > $O/test-$t.log 2>&1 &
  P+=($!)
done
wait "${P[@]}"
for t in attention model conformance gpu hybrid graph; do echo "$t: $(grep -E '^test result' $O/test-$t.log | tail -1)"; done
grep -h "decode on tensor cores vs\|decode vs reference" $O/test-attention.log
timeout 60 python3 bench/gpu/serve-check.py /tmp/bin/ember > $O/serve-check.log 2>&1; echo "serve-check: exit $?"
wait $SY; echo "synth done at $SECONDS s"
(( SECONDS < L - 50 )) && OUT=$O VARIANTS='default:;scalar:EMBER_ATTN_DECODE_MMA=0' VARIANT_ARGS='-p 0 -n 128 -d 0,32768' ROUNDS=1 LLAMA=0 STAGES=variants \
  timeout $(( L - 8 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "done at $SECONDS s"
(cd ${OUT} && tar czf n.tgz n && rm -rf n)
