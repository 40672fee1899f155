#!/usr/bin/env bash
# Call A (main 51206b2 + the staged int8 gate/up): every GPU test binary + serve-check while
# llama.cpp builds and the 35B is written; the MoE microbenchmark; the split on one GPU after the
# KV-cap fix; decode with rows' best entries against whole rows; prompts staged vs not.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/w
OUT=$O/w STAGES=tests,serve ./bench/gpu/h200.sh
OUT=$O/w STAGES=micro MICRO=gpu:bench_moe_prompt ./bench/gpu/h200.sh
export EMBER_KERNEL_CACHE=/tmp/kc; E=/tmp/bin/ember; F=/tmp/m/35b.gguf
sum() { python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$1" 2>/dev/null; }
b() { local tag=$1; shift; env "$@" timeout 150 $E bench -m $F --device cuda -p 512 -n 128 -r 2 -o json > $O/w/$tag.json 2> $O/w/$tag.log
  echo "$tag: exit $? $(sum $O/w/$tag.json) $(grep -m1 -i 'error' $O/w/$tag.log)"; }
pp() { local tag=$1; shift; env "$@" timeout 150 $E bench -m $F --device cuda -p 512,2048 -n 0 -r 3 -o json > $O/w/$tag.json 2> $O/w/$tag.log
  echo "$tag: exit $? $(sum $O/w/$tag.json) $(grep -m1 -i 'error' $O/w/$tag.log)"; }
for r in 1 2; do pp pp-staged-$r; pp pp-direct-$r EMBER_MOE_MMA8_STAGED=0; pp pp-rolled-$r EMBER_KERNEL_DEFINES=EMBER_MOE8S_ROLLED; done
b split1 EMBER_SPLIT_PARTS=1
b split2 EMBER_SPLIT_PARTS=2
b split2host EMBER_SPLIT_PARTS=2 EMBER_SPLIT_DEVICE_COPY=0
grep -h "device:" $O/w/split2.log | head -5
tg() { local tag=$1; shift; env "$@" timeout 60 $E bench -m $F --device cuda -p 0 -n 128 -r 3 -o json > $O/w/tg-$tag.json 2> $O/w/tg-$tag.log; echo "tg $tag: $(sum $O/w/tg-$tag.json)"; }
for r in 1 2; do tg top-$r; tg rows-$r EMBER_TOP_READS=0; done
(cd $O && tar czf w.tgz w && rm -rf w)
echo "done at $SECONDS s"
