#!/usr/bin/env bash
# The shortest call (~150 s): the GPU tests of the work not yet run on a GPU, no benchmarks:
# wgmma (the building blocks; which way V's descriptor reads), ahead (decode steps queued ahead
# against steps run one by one; an unfed step does not hang), attention's tiles with
# attention_wg at the wide tiles (against attention_mma_w8 and the reference).
set -uo pipefail
O=${OUT:?}/v; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
t() { local n=$1; shift; local t0=$SECONDS; env "$@" timeout 100 /tmp/bin/$n --test-threads=1 --nocapture ${FILTER:-} > $O/test-$n${TAG:-}.log 2>&1
  echo "test $n${TAG:-}: exit $? in $(( SECONDS - t0 )) s: $(grep '^test result' $O/test-$n${TAG:-}.log | tail -1)"; }
t wgmma
SW=
grep -q "with (1024, 8192) it matches: true" $O/test-wgmma.log && SW=EMBER_ATTN_V_SWAP
grep -E '^V offsets' $O/test-wgmma.log; echo "V swap: ${SW:-no}"
D=(); [[ -n $SW ]] && D=(EMBER_KERNEL_DEFINES=$SW)
(FILTER=tile TAG=-wg t attention "${D[@]}" EMBER_ATTN_WG=1 EMBER_ATTN_MMA_WIDE=1) & AT=$!
t ahead
wait $AT
grep -E 'tiles vs reference|against attention_mma_w8|head_dim 256 .*F16 Fast|panicked' $O/test-attention-wg.log
echo "done at $SECONDS s"
(cd ${OUT} && tar czf v.tgz v && rm -rf v)
