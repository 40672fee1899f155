#!/usr/bin/env bash
# Call U: the in-GPU launch timeline (EMBER_CUDA_TRACE, kernels built with EMBER_TRACE) of
# decode at depth 0 (fusions on, then off), at depth 32768, 16 sequences at depth 4096, and a
# 512-token prompt, on the full 35B; bench/gpu/trace.py's tables. An untraced tg64 first.
set -uo pipefail
O=${OUT:?}/u; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz; E=/tmp/bin/ember; M=/tmp/m; mkdir -p $M; F=$M/35b.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $O/gpu.txt
[[ -s $F ]] || { $E synth -o $F.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1 && mv $F.tmp $F; }
echo "synth done at $SECONDS s"
sum() { python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+('@d%d'%x['n_depth'] if x.get('n_depth') else '')+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$1" 2>/dev/null; }
b() { local name=$1; shift; local envs=(); while [[ $1 == *=* ]]; do envs+=("$1"); shift; done
      env "${envs[@]}" timeout 200 $E bench -m $F --device cuda "$@" -o json > $O/$name.json 2> $O/$name.log
      echo "$name: exit $? $(sum $O/$name.json) at $SECONDS s"; }
T=(EMBER_KERNEL_DEFINES=EMBER_TRACE)
b plain-tg64 -p 0 -n 64 -r 2
b tr-tg64 "${T[@]}" EMBER_CUDA_TRACE=$O/tr-tg64.txt -p 0 -n 64 -r 1
b tr-tg64-off "${T[@]}" EMBER_CUDA_TRACE=$O/tr-tg64-off.txt EMBER_GEMV_MIXED=0 EMBER_DELTA_PREP_FUSED=0 -p 0 -n 64 -r 1
b tr-d32k "${T[@]}" EMBER_CUDA_TRACE=$O/tr-d32k.txt -p 0 -n 32 -d 32768 -r 1
b tr-16seq "${T[@]}" EMBER_CUDA_TRACE=$O/tr-16seq.txt --n-seq 16 -p 0 -n 32 -d 4096 -r 1
b tr-pp512 "${T[@]}" EMBER_CUDA_TRACE=$O/tr-pp512.txt -p 512 -n 0 -r 3
for t in tg64 tg64-off d32k 16seq; do python3 bench/gpu/trace.py $O/tr-$t.txt > $O/tr-$t.md 2>&1; echo "== $t"; head -45 $O/tr-$t.md; done
python3 bench/gpu/trace.py $O/tr-pp512.txt --skip 0 > $O/tr-pp512.md 2>&1; echo "== pp512"; head -40 $O/tr-pp512.md
echo "done at $SECONDS s"
xz -T4 $O/tr-*.txt
(cd ${OUT} && tar czf u.tgz u && rm -rf u)
