#!/usr/bin/env bash
# Call J: the decode attention's prefetch ring and per-(type, heads) entries, and attention_mma's
# ldmatrix fragments. Tests that cover them (attention, conformance, model, hybrid) at the new
# tree; the kernels' microbenchmarks under the new kernels, their switches (EMBER_AD_PF0: no ring;
# EMBER_ATM_LDS32: the old fragment loads) and the old binaries (7e40934); then ember bench on the
# 35B (pp512, tg128 at depth 0 and 32768) new / switches off / old, alternating, two rounds.
set -uo pipefail
O=${OUT:?}/j; mkdir -p $O
tar -C /tmp -xJf .gpu/j.tar.xz  # bin/ (new: ember and four test binaries) and old/ (7e40934: ember, attention)
export EMBER_KERNEL_CACHE=/tmp/kc
E=/tmp/bin/ember; EO=/tmp/old/ember; M=/tmp/m; F=$M/35b.gguf; mkdir -p $M
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
( $E synth -o $F.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv $F.tmp $F ) & SY=$!
timeout 200 /tmp/bin/attention --test-threads=1 > $O/test-attention.log 2>&1 & AT=$!
for t in conformance model hybrid; do
  timeout 200 /tmp/bin/$t --test-threads=1 > $O/test-$t.log 2>&1; echo "test $t: exit $? $(grep '^test result' $O/test-$t.log | tail -1)"
done
wait $AT; echo "test attention: exit $? $(grep '^test result' $O/test-attention.log | tail -1)"
echo "tests done at $SECONDS s"
micro() {  # name binary filter [defines]
  EMBER_KERNEL_DEFINES=${4:-} timeout 120 $2 --ignored --test-threads=1 --nocapture $3 > $O/micro-$1.log 2>&1
  echo "micro $1: exit $?"; grep -E '^(decode heads|bench attention_mma)' $O/micro-$1.log
}
micro dec-new /tmp/bin/attention bench_attention_decode_heads
micro dec-pf0 /tmp/bin/attention bench_attention_decode_heads EMBER_AD_PF0
micro dec-old /tmp/old/attention bench_attention_decode_heads
micro mma-new /tmp/bin/attention bench_attention_mma
micro mma-lds32 /tmp/bin/attention bench_attention_mma EMBER_ATM_LDS32
echo "micro done at $SECONDS s"
wait $SY; echo "synth done at $SECONDS s"
for r in 1 2; do
  for v in new off old; do
    (( SECONDS > 540 )) && break 2
    case $v in
      new) B=$E; D= ;;
      off) B=$E; D=EMBER_AD_PF0,EMBER_ATM_LDS32 ;;
      old) B=$EO; D= ;;
    esac
    EMBER_KERNEL_DEFINES=$D timeout 60 $B bench -m $F --device cuda -p 512 -n 128 -d 0,32768 -r 2 -o json > $O/e2e-$v-$r.json 2> $O/e2e-$v-$r.log
    echo "e2e $v round $r: exit $? $(python3 -c "import json,sys; print([(x.get('n_prompt'), x.get('n_gen'), x.get('n_depth'), round(x['avg_ts'],1)) for x in json.load(open(sys.argv[1]))])" $O/e2e-$v-$r.json 2>/dev/null)"
  done
done
echo "done at $SECONDS s"
(cd ${OUT} && tar czf j.tgz j && rm -rf j)
