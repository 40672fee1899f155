#!/usr/bin/env bash
# On the H200 (run from the repo root, .gpu/ from bench/gpu/pack.sh carried): builds llama.cpp
# with CUDA for sm_90 while ember writes the full-size synthetic 35B-A3B Q4_K_M, then runs both
# engines on that file, alternating, ROUNDS times: pp512 / tg128 at depth 0 and tg128 at
# DEPTHS. Results and logs under $OUT. Takes ~8-9 minutes; call with timeout_s 600.
set -uo pipefail
O=${OUT:-/tmp/out}; M=/tmp/m; mkdir -p "$O" "$M" /tmp/llama
ROUNDS=${ROUNDS:-2}; DEPTHS=${DEPTHS:-8192}
export EMBER_KERNEL_CACHE=/tmp/kc
xz -dkf .gpu/ember.xz; E=$PWD/.gpu/ember
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$O/gpu.txt"
( cd /tmp/llama && tar xJf "$OLDPWD/.gpu/llama-src.tar.xz" \
  && cmake -S llama.cpp -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > "$O/llama-cmake.log" 2>&1 \
  && cmake --build build --target llama-bench -j 12 > "$O/llama-build.log" 2>&1; echo "llama build exit $?" ) &
LB=$!
t0=$(date +%s)
$E synth -o $M/35b.gguf --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > "$O/synth.log" 2>&1
echo "synth: $(( $(date +%s) - t0 )) s"
wait $LB
L=/tmp/llama/build/bin/llama-bench
[[ -x $L ]] || { echo "llama-bench missing"; tail -20 "$O/llama-build.log"; }
for r in $(seq 1 "$ROUNDS"); do
  for eng in ember llama; do
    if [[ $eng == ember ]]; then
      ( time $E bench -m $M/35b.gguf --device cuda -p 512 -n 128 -r 3 -o json ) > "$O/ember-d0-$r.json" 2> "$O/ember-d0-$r.log"
      $E bench -m $M/35b.gguf --device cuda -p 0 -n 128 -d "$DEPTHS" -r 2 -o json > "$O/ember-d-$r.json" 2> "$O/ember-d-$r.log"
    elif [[ -x $L ]]; then
      ( time $L -m $M/35b.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json ) > "$O/llama-d0-$r.json" 2> "$O/llama-d0-$r.log"
      $L -m $M/35b.gguf -ngl 99 -fa 1 -p 0 -n 128 -d "$DEPTHS" -r 2 -o json > "$O/llama-d-$r.json" 2> "$O/llama-d-$r.log"
    fi
  done
done
python3 - "$O" <<'PY'
import json, glob, sys, os
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], '*-d*-*.json'))):
    eng = os.path.basename(f).split('-')[0]
    try:
        for x in json.load(open(f)):
            t = x.get('name') or (('pp%d' % x['n_prompt'] if x['n_prompt'] else 'tg%d' % x['n_gen']) + ('@d%d' % x['n_depth'] if x.get('n_depth') else ''))
            rows.setdefault(t, {}).setdefault(eng, []).append(x['avg_ts'])
    except Exception as e:
        print(f, 'unreadable:', e)
print('| test | ember t/s (rounds) | llama.cpp t/s (rounds) | ratio of means |')
print('| --- | --- | --- | ---: |')
for t, d in rows.items():
    e, l = d.get('ember', []), d.get('llama', [])
    ratio = (sum(e) / len(e)) / (sum(l) / len(l)) if e and l else float('nan')
    print(f"| {t} | {' '.join('%.1f' % v for v in e)} | {' '.join('%.1f' % v for v in l)} | {ratio:.2f} |")
PY
