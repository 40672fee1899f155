#!/usr/bin/env bash
# A minimal call for the tensor-core decode attention alone (~90 s): its test and the scalar
# decode tests beside it, then bench_attention_decode_mma under entries w4s2 and w4s3.
set -uo pipefail
O=${OUT:?}/m; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz bin/attention
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
EMBER_ATTN_DECODE_MMA=1 timeout 60 /tmp/bin/attention --test-threads=1 --nocapture decode_ > $O/test-adm.log 2>&1
echo "decode tests (EMBER_ATTN_DECODE_MMA=1): exit $? $(grep '^test result' $O/test-adm.log)"
grep -E "tensor cores|ranges per row" $O/test-adm.log | head -20
for v in w4s2 w4s3; do
  EMBER_ATTN_DECODE_MMA=$v timeout 40 /tmp/bin/attention --ignored --test-threads=1 --nocapture --exact bench_attention_decode_mma > $O/micro-adm-$v.log 2>&1
  echo "micro $v: exit $?"; grep -E '^decode mma' $O/micro-adm-$v.log | sed 's/^decode mma //'
done
