#!/usr/bin/env bash
# On the H200 (run from the repo root with .gpu/ from bench/gpu/pack.sh carried). Stages, named
# in STAGES (default: all, in this order), each also fine alone on a warm machine that ran the
# earlier ones (everything it makes lives under /tmp and is reused when there):
#   tests  ember-cuda's test binaries on the GPU (logs test-*.log), while llama.cpp builds
#          (CUDA, sm_90, llama-bench and llama-completion; the build runs on in its own session
#          when the call ends) and `ember synth` writes the full-size 35B-A3B Q4_K_M
#   serve  bench/gpu/serve-check.py: `ember serve --device cuda` end to end (bundled model)
#   load   load to first token, both engines on the 35B file: ember's first start with an empty
#          kernel cache, then ROUNDS alternations of `ember run -n 1` / `llama-completion -n 1`
#   bench  `ember bench --device cuda` and `llama-bench -ngl 99 -fa 1`, alternating, ROUNDS
#          times: pp512 and tg128 at depth 0 and at DEPTHS; prints the table of rounds and ratios
# Results and logs under $OUT. Plan ~5 min for tests+serve, ~5 min for load+bench (timeout_s 600).
set -uo pipefail
O=${OUT:-/tmp/out}; M=/tmp/m; L=/tmp/llama; mkdir -p "$O" "$M" "$L"
ROUNDS=${ROUNDS:-2}; DEPTHS=${DEPTHS:-8192,32768}; STAGES=${STAGES:-tests,serve,load,bench}
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember && /tmp/bin/ember -nt .gpu/bin.tar.xz ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember; F=$M/35b.gguf
LB=$L/build/bin/llama-bench; LC=$L/build/bin/llama-completion
has() { [[ ",$STAGES," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$O/gpu.txt"

start_llama_build() {
    [[ -x $LB && -x $LC ]] && return
    [[ -f $L/building ]] && return
    touch $L/building
    setsid bash -c "cd $L && tar xJf '$PWD/.gpu/llama-src.tar.xz' \
      && cmake -S llama.cpp -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
           -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > $L/cmake.log 2>&1 \
      && cmake --build build --target llama-bench llama-completion -j 12 > $L/build.log 2>&1; echo \$? > $L/built; rm -f $L/building" \
      < /dev/null > /dev/null 2>&1 &
}
wait_llama_build() {
    while [[ -f $L/building ]]; do sleep 2; done
    cp $L/cmake.log $L/build.log "$O/" 2>/dev/null
    [[ -x $LB ]] || { echo "llama.cpp build failed:"; tail -20 $L/build.log; }
}
ensure_model() {
    [[ -s $F ]] && return
    local t0=$(date +%s)
    $E synth -o $F.tmp --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > "$O/synth.log" 2>&1 && mv $F.tmp $F
    echo "synth: $(( $(date +%s) - t0 )) s"
}
secs() { local t0=$EPOCHREALTIME; "$@" < /dev/null > /dev/null 2>&1; local rc=$?; awk -v a="$t0" -v b="$EPOCHREALTIME" -v rc=$rc 'BEGIN { printf "%.2f s (exit %d)", b - a, rc }'; }

if has tests || has load || has bench; then start_llama_build; fi
if has tests; then
    ensure_model &
    SY=$!
    for t in /tmp/bin/*; do
        n=$(basename "$t"); [[ $n == ember ]] && continue
        t0=$(date +%s)
        timeout 300 "$t" --test-threads=1 --nocapture > "$O/test-$n.log" 2>&1
        echo "test $n: exit $? in $(( $(date +%s) - t0 )) s: $(grep '^test result' "$O/test-$n.log" | tail -1)"
    done
    wait $SY
fi
if has serve; then
    timeout 240 python3 bench/gpu/serve-check.py $E > "$O/serve-check.log" 2>&1
    echo "serve-check: exit $?"; grep -E '^(ok|FAIL)' "$O/serve-check.log"
fi
if has load; then
    ensure_model
    rm -rf "$EMBER_KERNEL_CACHE"
    echo "ember, empty kernel cache: $(secs $E run -m $F --device cuda -p Hello -n 1 --temp 0)"
    wait_llama_build
    for r in $(seq 1 "$ROUNDS"); do
        echo "round $r: ember run -n 1: $(secs $E run -m $F --device cuda -p Hello -n 1 --temp 0)"
        [[ -x $LC ]] && echo "round $r: llama-completion -n 1: $(secs $LC -m $F -ngl 99 -fa on -no-cnv -p Hello -n 1 --temp 0)"
    done
    $E run -m $F --device cuda -p Hello -n 1 --temp 0 > "$O/ember-run.log" 2>&1
    [[ -x $LC ]] && $LC -m $F -ngl 99 -fa on -no-cnv -p Hello -n 1 --temp 0 < /dev/null > "$O/llama-completion.log" 2>&1
fi
if has bench; then
    ensure_model; wait_llama_build
    for r in $(seq 1 "$ROUNDS"); do
        for eng in ember llama; do
            t0=$(date +%s)
            if [[ $eng == ember ]]; then
                $E bench -m $F --device cuda -p 512 -n 128 -d 0,$DEPTHS -r 2 -o json > "$O/ember-$r.json" 2> "$O/ember-$r.log"
            elif [[ -x $LB ]]; then
                $LB -m $F -ngl 99 -fa 1 -p 512 -n 128 -d 0,$DEPTHS -r 2 -o json > "$O/llama-$r.json" 2> "$O/llama-$r.log"
            fi
            echo "round $r $eng: exit $? in $(( $(date +%s) - t0 )) s"
        done
    done
    python3 - "$O" <<'PY'
import json, glob, sys, os
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], '*-[0-9].json'))):
    eng = os.path.basename(f).split('-')[0]
    try:
        for x in json.load(open(f)):
            t = ('pp%d' % x['n_prompt'] if x['n_prompt'] else 'tg%d' % x['n_gen']) + ('@d%d' % x['n_depth'] if x.get('n_depth') else '')
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
fi
