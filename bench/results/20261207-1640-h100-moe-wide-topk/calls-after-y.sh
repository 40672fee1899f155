#!/usr/bin/env bash
# The calls that followed callY.sh on the same warm H100 (each run from the repository root with
# .gpu carried; OUT set by the device). Kept as run.
export EMBER_KERNEL_CACHE=/tmp/kc; E=/tmp/bin/ember; F=/tmp/m/35b.gguf
A="EMBER_MOE_GU_WIDE=1 EMBER_DELTA_NORM_FUSED=1 EMBER_TOPK_CHUNK=2048"
case ${1:?z, t, w, v or b} in
z)  # issue 19's table at the packed tree's defaults (llama.cpp built by callY.sh)
    O=$OUT/z; mkdir -p $O
    OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout 230 ./bench/gpu/h200.sh
    OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout 200 ./bench/gpu/h200.sh ;;
t)  # launch traces of tg64: defaults, each switch, defaults again
    O=$OUT/t; mkdir -p $O
    for v in two: guw:EMBER_MOE_GU_WIDE=1 norm:EMBER_DELTA_NORM_FUSED=1 tk2k:EMBER_TOPK_CHUNK=2048 two2: ; do
      n=${v%%:*}
      env ${v#*:} EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-$n.txt timeout 90 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-$n.json 2> $O/tr-$n.log
      python3 bench/gpu/trace.py $O/tr-$n.txt > $O/tr-$n.md 2>&1
    done ;;
w)  # the three switches together: tests, tg128 A/B (4 rounds in turn), a trace
    O=$OUT/w; mkdir -p $O
    for t in model references conformance hybrid; do env $A timeout 60 /tmp/bin/$t --test-threads=1 > $O/test-$t-all3.log 2>&1; done
    OUT=$O ROUNDS=4 VARIANT_ARGS='-p 0 -n 128' VARIANTS="two:;all3:$A" STAGES=variants timeout 120 ./bench/gpu/h200.sh
    env $A EMBER_KERNEL_DEFINES=EMBER_TRACE EMBER_CUDA_TRACE=$O/tr-all3.txt timeout 60 $E bench -m $F --device cuda -p 0 -n 64 -r 1 -o json > $O/tr-all3.json 2> $O/tr-all3.log
    python3 bench/gpu/trace.py $O/tr-all3.txt > $O/tr-all3.md ;;
v)  # issue 19's table with the three switches
    O=$OUT/v; mkdir -p $O
    env $A OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout 100 ./bench/gpu/h200.sh
    env $A OUT=$O NSEQ=16 BDEPTH=4096 ROUNDS=1 STAGES=batched timeout 80 ./bench/gpu/h200.sh ;;
b)  # 16 sequences at depth 4096, each switch alone, two rounds in turn (printed only; README)
    for r in 1 2; do for v in two: norm:EMBER_DELTA_NORM_FUSED=1 tk2k:EMBER_TOPK_CHUNK=2048 guw:EMBER_MOE_GU_WIDE=1; do
      env ${v#*:} timeout 40 $E bench -m $F --device cuda -p 0 -n 64 --n-seq 16 -d 4096 -r 1 -o json 2>/dev/null |
        python3 -c "import json,sys; print(json.load(sys.stdin)[0]['avg_ts'])"
    done; done ;;
esac
