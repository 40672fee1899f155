#!/usr/bin/env bash
# On the H200 (run from the repo root with .gpu/ from bench/gpu/pack.sh carried). Stages, named
# in STAGES (default: all, in this order), each also fine alone on a warm machine that ran the
# earlier ones (everything it makes lives under /tmp and is reused when there):
#   tests  ember-cuda's test binaries on the GPU (logs test-*.log; SKIP_TESTS=a,b leaves some out;
#          TESTS_BESIDE=a,b (default gemv_q8,attention, the two slowest: ~95 and ~80 s) run each
#          in its own process beside the rest, which run one after another: ~2 minutes instead
#          of ~4; tests are correctness only, so sharing the GPU changes nothing), while llama.cpp builds
#          (CUDA, sm_90, llama-bench and llama-completion; the build runs on in its own session
#          when the call ends) and `ember synth` writes the full-size 35B-A3B Q4_K_M
#   serve  bench/gpu/serve-check.py: `ember serve --device cuda` end to end (bundled model)
#   load   load to first token, both engines on the 35B file: ember's first start with an empty
#          kernel cache, then ROUNDS alternations of `ember run -n 1` / `llama-completion -n 1`
#   bench  `ember bench --device cuda` and `llama-bench -ngl 99 -fa 1`, alternating, ROUNDS
#          times: pp at PROMPTS (default 512; issue 19 wants 512,8192) and tg128 at depth 0 and at
#          DEPTHS; prints the table of rounds and ratios
#   tier   the expert tier (issue 20) on the ud-q4_k_m 35B (synthesised when missing): per budget
#          in BUDGETS (GiB=ncmoe pairs, default 20=6,12=23,8=31: llama.cpp's best fitting -ncmoe
#          per budget, from the issue), `ember bench --gpu-mem 0=B` (tg128, pp2048, 128k context
#          budgeted with q8_0 KV, --prompts real, THREADS threads) twice (the second starts from
#          the heat file the first saved) against `llama-bench -ncmoe N -ctk q8_0 -ctv q8_0`
#   micro  the ignored microbenchmarks of ember-cuda's test binaries, MICRO (default
#          matmul:bench_mmv,matmul:bench_mmv_prompt,gpu:bench_moe_prompt: binary:filter pairs), each
#          under 150 s, logs micro-<binary>-<filter>.log (a filter no test matches runs nothing)
#   kprofile  EMBER_CUDA_PROFILE=1 (every kernel timed, no graphs) on the 35B: 16 sequences'
#          decode (`-p 0 -n 32 --n-seq 16`) and a 512-token prompt, logs kprofile-*.txt
#   mem    device memory of one prompt step: peak `nvidia-smi memory.used` (100 ms samples) of
#          `ember bench -p P -n 0 -r 1 --no-warmup` on the 35B for each P of MEM_PROMPTS (default
#          512,8192,16384), each also with MEM_AB set (e.g. MEM_AB=EMBER_ARENA_FREE=0), against
#          the weights' bytes; logs mem-*.log
#   ncu    why the top kernels take what they take: Nsight Compute's speed-of-light, scheduler,
#          warp-state (stall reasons), occupancy and memory sections for NCU_COUNT (default 12)
#          launches after the first 10 of the kernels that lead each profile: a 512-token prompt's
#          (the grouped MoE, the Q4_K tiles) and 16 sequences' decode (mmv, the per-pair int8
#          MoE), on the 35B (EMBER_CUDA_GRAPH=0: ncu profiles launches, not graph nodes); logs
#          ncu-pp512.txt, ncu-16seq.txt. NCU_RUNS (`;`-separated `name:kernel regex:bench args`)
#          replaces the two, e.g. one-token decode's GEMVs and MoE:
#          NCU_RUNS='tg:gemv_q8_q|moe_gate_up_q8_q|moe_down_q8_q:-p 0 -n 4'
#   profile  per-kernel GPU time of a decode step (ncu, durations only) on the 35B shape cut to 8
#          layers: `ember run -n 1` and `-n 9` profiled, differenced by bench/gpu/ncu-diff.py
#          (profile.md), then `ember bench` on that file
#   ebench `ember bench --device cuda` alone on the full-size 35B (pp512, tg128, ROUNDS rounds)
#   ab     `ember bench --device cuda` on the full-size 35B with and without the environment
#          AB (e.g. AB=EMBER_GEMV_Q8=0: the change off), alternating, ROUNDS rounds, AB_ARGS
#          (default -p 512 -n 128)
#   variants  `ember bench --device cuda` on the full-size 35B under each of VARIANTS
#          (`;`-separated `name:ENV=V ENV=V`, an empty list of switches for the defaults), in
#          turn, ROUNDS rounds, VARIANT_ARGS (default -p 512,2048,8192 -n 0); logs variant-*.json
#          and a table of rounds per variant, e.g. VARIANTS='new:;old:EMBER_MATMUL_MMA8=0'
#   tvariants  the launch trace (kernels built with EMBER_TRACE; TVARIANT_ARGS, default -p 0 -n 64)
#          under each of VARIANTS, in turn, ROUNDS rounds: the median step, the host's gap after
#          its last launch, and the GPU chain (their difference), which separates changes of
#          ~0.5 % where tg128's rounds spread ±2 % (docs/perf.md g30); a variant's own kernel
#          defines go in its EMBER_KERNEL_DEFINES (EMBER_TRACE is added); logs tvariant-*.md
#          (trace.py's table), tvariant-*.txt.xz
#   batched  decode of NSEQ (default 16) sequences at once at depth BDEPTH (default 4096):
#          `ember bench --n-seq 1,NSEQ -p 0 -n 128 -d BDEPTH` against `llama-batched-bench -npp
#          BDEPTH -ntg 128 -npl 1,NSEQ` (its S_TG: the decode phase's tokens/s over all
#          sequences), alternating, ROUNDS rounds (LLAMA=0: ember only)
#   pressure  bench/gpu/pressure.py: `ember serve` on the ud-q4_k_m 35B while another process
#          takes GPU memory in steps below the server's reserve and gives it back
#   ghttp  issue 19's HTTP figure: `ember serve --device cuda` + `ember bench-http` (greedy,
#          depth 512, one client) against `ember bench -p 512 -n 128 -d 0,512`, for each of
#          HTTP_AB (default: the defaults alone), ROUNDS rounds; logs ghttp-*.json
#   cpuab  ember against itself on this host's CPU (GPU hidden) with and without the environment
#          CPU_AB (e.g. CPU_AB=EMBER_CPU_PAR_ZEROS=1), alternating, ROUNDS rounds, at each of
#          CPU_THREADS (default 16,8): `ember bench --device cpu -t T -p 512 -n 128 -r 2`
#   skip   what each decode kernel costs in the chain of a step: tg128 (`-p 0 -n 128 -r 3`) on the
#          35B with each of SKIPS (`;`-separated `name:entry,entry`, default: every small kernel
#          together, then the norms, the MoE's gate/up, its down, the projections' GEMVs, conv,
#          route, the router, delta prep, the delta rule, attention's four) left out after 300
#          launches each (EMBER_CUDA_SKIP: the results are wrong, timing only), between two
#          runs with nothing left out; SKIP_BY (default 560) s into the call, the rest is left
#   cpu    issue 18 on this host's CPU, the GPU hidden (CUDA_VISIBLE_DEVICES=): the `bandwidth`
#          example, then on the q4_k_m 35B at each of CPU_THREADS (default 16,8), alternating,
#          ROUNDS rounds: `ember bench --device cpu -t T -p 512 -n 128 -d 0,CPU_DEPTHS` (default
#          4096) against `llama-bench -ngl 0 -fa 1` with the same arguments (-r CPU_REPS, default
#          2, for both); then (CPU_HTTP=1,
#          default) `ember serve --device cpu -t 16` + `ember bench-http --depths 512` against
#          `ember bench -d 0,512` (the HTTP path, item 4); before it (CPU_PROFILE=1, default)
#          decode's per-op profile at 16 threads at depths 0 and CPU_DEPTHS' first, and a
#          512-token prompt's at 16 and 8 threads (model_bench)
# Results and logs under $OUT. Plan ~5 min for tests+serve, ~5 min for load+bench (timeout_s 600).
set -uo pipefail
O=${OUT:-/tmp/out}; M=/tmp/m; L=/tmp/llama; mkdir -p "$O" "$M" "$L"
ROUNDS=${ROUNDS:-2}; DEPTHS=${DEPTHS:-8192,32768}; STAGES=${STAGES:-tests,serve,load,bench}
export EMBER_KERNEL_CACHE=/tmp/kc
[[ -x /tmp/bin/ember && /tmp/bin/ember -nt .gpu/bin.tar.xz ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
E=/tmp/bin/ember; F=$M/35b.gguf
LB=$L/build/bin/llama-bench; LC=$L/build/bin/llama-completion; LBB=$L/build/bin/llama-batched-bench
has() { [[ ",$STAGES," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$O/gpu.txt"

start_llama_build() {
    [[ -x $LB && -x $LC && -x $LBB ]] && return
    [[ -f $L/building ]] && return
    touch $L/building
    setsid bash -c "cd $L && tar xJf '$PWD/.gpu/llama-src.tar.xz' \
      && cmake -S llama.cpp -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
           -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > $L/cmake.log 2>&1 \
      && cmake --build build --target llama-bench llama-completion llama-batched-bench -j 12 > $L/build.log 2>&1; echo \$? > $L/built; rm -f $L/building" \
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

if (has tests || has load || has bench || has tier || has batched || has cpu) && [[ ${LLAMA:-1} == 1 ]]; then start_llama_build; fi
# UD_SYNTH=1: the ud-q4_k_m 35B for the tier stage, written in its own session (it survives
# the call, like the llama.cpp build) so a later call finds it.
if [[ ${UD_SYNTH:-0} == 1 && ! -s $M/35b-ud.gguf && ! -f $M/35b-ud.gguf.synthing ]]; then
    touch $M/35b-ud.gguf.synthing
    setsid bash -c "$E synth -o $M/35b-ud.gguf.tmp --preset 35b-a3b --quant ud-q4_k_m --seed 0 --skew 1 > $M/synth-ud.log 2>&1 \
        && mv $M/35b-ud.gguf.tmp $M/35b-ud.gguf; rm -f $M/35b-ud.gguf.synthing" < /dev/null > /dev/null 2>&1 &
fi
if has tests; then
    # The q4_k_m 35B for load/bench (SYNTH=0: not needed by the stages that follow).
    if [[ ${SYNTH:-1} == 1 ]]; then ensure_model & SY=$!; else SY=; fi
    run_test() {
        local t=$1 n t0=$(date +%s); n=$(basename "$1")
        timeout 300 "$t" --test-threads=1 --nocapture > "$O/test-$n.log" 2>&1
        echo "test $n: exit $? in $(( $(date +%s) - t0 )) s: $(grep '^test result' "$O/test-$n.log" | tail -1)"
    }
    BESIDE=()
    for t in /tmp/bin/*; do
        n=$(basename "$t"); [[ $n == ember || $n == bandwidth || $n == model_bench || ",${SKIP_TESTS:-}," == *",$n,"* ]] && continue
        if [[ ",${TESTS_BESIDE-gemv_q8,attention}," == *",$n,"* ]]; then run_test "$t" & BESIDE+=($!); fi
    done
    for t in /tmp/bin/*; do
        n=$(basename "$t"); [[ $n == ember || $n == bandwidth || $n == model_bench || ",${SKIP_TESTS:-}," == *",$n,"* ]] && continue
        [[ ",${TESTS_BESIDE-gemv_q8,attention}," == *",$n,"* ]] || run_test "$t"
    done
    [[ ${#BESIDE[@]} -gt 0 ]] && wait "${BESIDE[@]}"
    [[ -n $SY ]] && wait $SY
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
if has micro; then
    for m in $(echo "${MICRO:-matmul:bench_mmv,matmul:bench_mmv_prompt,gpu:bench_moe_prompt}" | tr , ' '); do
        b=${m%%:*}; f=${m#*:}
        [[ -x /tmp/bin/$b ]] || { echo "micro $m: no binary"; continue; }
        timeout 150 /tmp/bin/$b --ignored --nocapture --test-threads=1 --exact "$f" > "$O/micro-$b-$f.log" 2>&1
        echo "micro $m: exit $?"; grep -E "^bench" "$O/micro-$b-$f.log" | head -60
    done
fi
if has kprofile; then
    ensure_model
    EMBER_CUDA_PROFILE=1 timeout 120 $E bench -m $F --device cuda -p 0 -n 32 -d 0 --n-seq 16 -r 1 > "$O/kprofile-16seq.txt" 2>&1
    EMBER_CUDA_PROFILE=1 timeout 60 $E bench -m $F --device cuda -p 512 -n 0 -r 1 > "$O/kprofile-pp512.txt" 2>&1
    for f in "$O"/kprofile-16seq.txt "$O"/kprofile-pp512.txt; do echo "$f:"; grep -A16 "GPU time per kernel" "$f"; done
fi
if has mem; then
    ensure_model
    for pp in $(echo "${MEM_PROMPTS:-512,8192,16384}" | tr , ' '); do
        for v in on ${MEM_AB:+off}; do
            if [[ $v == on ]]; then envs=(); else envs=("$MEM_AB"); fi
            nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > /tmp/mem.txt & SMI=$!
            env "${envs[@]}" timeout 120 $E bench -m $F --device cuda -p $pp -n 0 -r 1 --no-warmup > "$O/mem-$pp-$v.log" 2>&1; rc=$?
            kill $SMI; wait $SMI 2>/dev/null
            echo "mem pp$pp $v: exit $rc, peak $(sort -n /tmp/mem.txt | tail -1) MiB (weights $(( $(stat -c %s $F) >> 20 )) MiB file); $(grep -E "^\| ember" "$O/mem-$pp-$v.log" | awk -F'|' '{print $8}') $(grep -m1 error "$O/mem-$pp-$v.log")"
        done
    done
fi
if has ncu; then
    ensure_model
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -n1)
    IFS=';' read -ra RUNS <<< "${NCU_RUNS:-pp512:moe_mma|matmul_mma:-p 512 -n 0;16seq:matmul_mmv|moe_gate_up_q8|moe_down_q8:-p 0 -n 4 --n-seq 16}"
    for run in "${RUNS[@]}"; do
        name=${run%%:*}; rest=${run#*:}; k=${rest%%:*}; args=${rest#*:}
        t0=$(date +%s)
        EMBER_CUDA_GRAPH=0 timeout 280 $NCU --kernel-name "regex:$k" --launch-skip 10 --launch-count ${NCU_COUNT:-12} \
            --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
            --section MemoryWorkloadAnalysis --section LaunchStats \
            $E bench -m $F --device cuda $args -r 1 --no-warmup > "$O/ncu-$name.txt" 2>&1
        echo "ncu $name: exit $? in $(( $(date +%s) - t0 )) s"
        grep -E "^  [a-z_0-9]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Achieved Occupancy|No Eligible|Registers Per" "$O/ncu-$name.txt" | head -60
    done
fi
if has profile; then
    FC=$M/cut8.gguf
    [[ -s $FC ]] || $E synth -o $FC --config '{"n_layer": 8}' --quant q4_k_m --seed 0 --skew 1 > "$O/synth-cut.log" 2>&1
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -n1)
    $E run -m $FC --device cuda -p "The quick brown fox" -n 1 --temp 0 > /dev/null 2>&1  # kernel cache
    for n in 1 9; do
        t0=$(date +%s)
        timeout 240 $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
            --log-file "$O/ncu-n$n.csv" $E run -m $FC --device cuda -p "The quick brown fox" -n $n --temp 0 > "$O/ncu-run-n$n.log" 2>&1
        echo "ncu n=$n: exit $? in $(( $(date +%s) - t0 )) s, $(grep -c . "$O/ncu-n$n.csv") lines"
    done
    python3 bench/gpu/ncu-diff.py "$O/ncu-n1.csv" "$O/ncu-n9.csv" 8 > "$O/profile.md" 2>&1; head -40 "$O/profile.md"
    $E bench -m $FC --device cuda -p 512 -n 128 -r ${ROUNDS} 2>&1 | grep -E "^\|" | tail -3
fi
if has ebench; then
    ensure_model
    $E bench -m $F --device cuda -p 512 -n 128 -r ${ROUNDS} -o json > "$O/ebench.json" 2> "$O/ebench.log"
    echo "ebench: exit $?"; python3 -c "import json,sys; [print('  ember', ('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen']), round(x['avg_ts'],1)) for x in json.load(open(sys.argv[1]))]" "$O/ebench.json"
fi
if has variants; then
    ensure_model
    IFS=';' read -ra VS <<< "${VARIANTS:-new:}"
    for r in $(seq 1 "$ROUNDS"); do
        for v in "${VS[@]}"; do
            name=${v%%:*}; envs=(${v#*:})
            env "${envs[@]}" timeout 200 $E bench -m $F --device cuda ${VARIANT_ARGS:--p 512,2048,8192 -n 0} -r 2 -o json \
                > "$O/variant-$name-$r.json" 2> "$O/variant-$name-$r.log"
            echo "variant $name round $r (${envs[*]}): exit $? $(python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+('@d%d'%x['n_depth'] if x.get('n_depth') else '')+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$O/variant-$name-$r.json" 2>/dev/null)"
        done
    done
fi
if has tvariants; then
    ensure_model
    IFS=';' read -ra VS <<< "${VARIANTS:-new:}"
    for r in $(seq 1 "$ROUNDS"); do
        for v in "${VS[@]}"; do
            name=${v%%:*}; envs=(${v#*:}); defs=EMBER_TRACE
            for e in "${envs[@]}"; do [[ $e == EMBER_KERNEL_DEFINES=* ]] && defs="$defs,${e#EMBER_KERNEL_DEFINES=}"; done
            t="$O/tvariant-$name-$r"
            env "${envs[@]}" EMBER_KERNEL_DEFINES="$defs" EMBER_CUDA_TRACE="$t.txt" timeout 150 $E bench -m $F --device cuda ${TVARIANT_ARGS:--p 0 -n 64} -r 1 -o json \
                > "$t.json" 2> "$t.log"
            rc=$?
            python3 bench/gpu/trace.py "$t.txt" > "$t.md" 2>&1
            echo "tvariant $name round $r (${envs[*]}): exit $rc $(python3 -c "
import re, sys
h = open(sys.argv[1]).readline()
m, a = re.search(r'median step ([0-9.]+) us', h), re.search(r'after the last launch ([0-9.]+) us', h)
n = re.search(r'of the same ([0-9]+) launches', h)
print(f'{n.group(1)} launches, step {float(m.group(1)):.1f} us, after it {float(a.group(1)):.1f}, chain {float(m.group(1)) - float(a.group(1)):.1f}' if m and a and n else h.strip())" "$t.md" 2>/dev/null)"
            xz -T4 -f "$t.txt" 2>/dev/null
        done
    done
fi
if has ghttp; then
    # Issue 19's HTTP figure: `ember serve --device cuda` + `ember bench-http` (one client,
    # greedy, depth 512, HTTP_RUNS runs) against `ember bench -p 512 -n 128 -d 0,512` in the same
    # call; each HTTP_AB variant (`;`-separated `name:ENV=V ..`, default the defaults alone) in
    # turn, ROUNDS rounds.
    ensure_model
    IFS=';' read -ra VS <<< "${HTTP_AB:-def:}"
    for r in $(seq 1 "$ROUNDS"); do
        for v in "${VS[@]}"; do
            name=${v%%:*}; envs=(${v#*:})
            env "${envs[@]}" timeout 200 $E bench -m $F --device cuda -p 512 -n 128 -d 0,512 -r 2 -o json > "$O/ghttp-bench-$name-$r.json" 2> "$O/ghttp-bench-$name-$r.log"
            env "${envs[@]}" $E serve -m $F --device cuda --port 8098 --parallel 1 -c 8192 > "$O/ghttp-serve-$name-$r.log" 2>&1 & S=$!
            for i in $(seq 1 240); do curl -s http://127.0.0.1:8098/v1/models > /dev/null && break; sleep 1; done
            timeout 200 $E bench-http --url http://127.0.0.1:8098 --depths 512 --n-predict 128 --runs ${HTTP_RUNS:-3} -o json > "$O/ghttp-$name-$r.json" 2> "$O/ghttp-$name-$r.log"
            echo "ghttp $name round $r (${envs[*]}): exit $?"; kill $S; wait $S 2>/dev/null
            python3 -c "
import json, sys
b = {('pp%d' % x['n_prompt'] if x['n_prompt'] else 'tg%d' % x['n_gen']) + ('@d%d' % x['n_depth'] if x.get('n_depth') else ''): x['avg_ts'] for x in json.load(open(sys.argv[1]))}
h = json.load(open(sys.argv[2]))[0]
print('  http prefill %.1f vs pp512 %.1f (%.3f); decode %.2f vs tg128@d512 %.2f (%.3f)' % (h['prefill_ts'], b['pp512'], h['prefill_ts'] / b['pp512'], h['decode_ts'], b['tg128@d512'], h['decode_ts'] / b['tg128@d512']))
" "$O/ghttp-bench-$name-$r.json" "$O/ghttp-$name-$r.json"
        done
    done
fi
if has cpuab; then
    ensure_model
    for th in $(echo "${CPU_THREADS:-16,8}" | tr , ' '); do
        for r in $(seq 1 "$ROUNDS"); do
            order="on off"; (( r % 2 == 0 )) && order="off on"
            for v in $order; do
                if [[ $v == on ]]; then envs=(${CPU_AB:?CPU_AB names the switch}); else envs=(); fi
                env "${envs[@]}" CUDA_VISIBLE_DEVICES= timeout 300 $E bench -m $F --device cpu -t $th -p 512 -n 128 -r 2 -o json > "$O/cpuab-$th-$v-$r.json" 2> "$O/cpuab-$th-$v-$r.log"
                echo "cpuab t$th round $r $v (${envs[*]}): exit $? $(python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$O/cpuab-$th-$v-$r.json" 2>/dev/null)"
            done
        done
    done
fi
if has skip; then
    ensure_model
    SM="rms_norm_q8,conv1d_silu_seqs,delta_prep,delta_rule_seqs,route,matmul_gemv_multi_f32,attn_prep,kv_append,attention_decode_f16_h1,attention_decode_f16_h2,attention_decode_f16_h4,attention_decode_f16_h8,gate"
    IFS=';' read -ra SK <<< "${SKIPS:-base:;small:$SM;norm:rms_norm_q8;gateup:moe_gate_up_q8_q4_k;down:moe_down_q8_q4_k,moe_down_q8_q6_k;proj:gemv_q8_q4_k,gemv_q8_q6_k;conv:conv1d_silu_seqs;route:route;router:matmul_gemv_multi_f32;prep:delta_prep;rule:delta_rule_seqs;attn:attn_prep,kv_append,attention_decode_f16_h1,attention_decode_f16_h2,attention_decode_f16_h4,attention_decode_f16_h8,gate;base2:}"
    for v in "${SK[@]}"; do
        name=${v%%:*}; entries=${v#*:}
        [[ $SECONDS -gt ${SKIP_BY:-560} ]] && { echo "skip $name: no time left"; continue; }
        EMBER_CUDA_SKIP=$entries EMBER_CUDA_SKIP_AFTER=300 timeout 60 $E bench -m $F --device cuda -p 0 -n 128 -r 3 > "$O/skip-$name.log" 2>&1
        echo "skip $name: exit $? $(grep -o 'run [0-9]/3: [0-9.]* tokens/s' "$O/skip-$name.log" | awk '{print $3}' | tr '\n' ' ')(${entries:-nothing left out})"
    done
fi
if has ab; then
    ensure_model
    for r in $(seq 1 "$ROUNDS"); do
        # Odd rounds run the switch's default first, even rounds second (the first of a pair
        # measured ~1.5 % slower where the switch could not matter).
        order="on off"; (( r % 2 == 0 )) && order="off on"
        for v in $order; do
            if [[ $v == on ]]; then envs=(); else envs=("$AB"); fi
            env "${envs[@]}" $E bench -m $F --device cuda ${AB_ARGS:--p 512 -n 128} -r 2 -o json > "$O/ab-$v-$r.json" 2> "$O/ab-$v-$r.log"
            echo "ab round $r $v ($AB): $(python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+('@d%d'%x['n_depth'] if x.get('n_depth') else '')+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$O/ab-$v-$r.json")"
        done
    done
fi
if has batched; then
    ensure_model; [[ ${LLAMA:-1} == 1 ]] && wait_llama_build
    NSEQ=${NSEQ:-16}; BDEPTH=${BDEPTH:-4096}
    for r in $(seq 1 "$ROUNDS"); do
        $E bench -m $F --device cuda -p 0 -n 128 -d $BDEPTH --n-seq 1,$NSEQ -r 2 -o json > "$O/batched-ember-$r.json" 2> "$O/batched-ember-$r.log"
        echo "batched round $r ember: exit $?: $(python3 -c "import json,sys; print(' '.join('%s %.1f' % (x['name'], x['avg_ts']) for x in json.load(open(sys.argv[1]))))" "$O/batched-ember-$r.json")"
        if [[ ${LLAMA:-1} == 1 && -x $LBB ]]; then
            $LBB -m $F -ngl 99 -fa on -c $(( NSEQ * (BDEPTH + 128) + 1024 )) -npp $BDEPTH -ntg 128 -npl 1,$NSEQ --output-format jsonl > "$O/batched-llama-$r.log" 2>&1
            echo "batched round $r llama.cpp: exit $?: $(grep '^{' "$O/batched-llama-$r.log" | python3 -c "import json,sys; print(' '.join('tg128x%d@d%d %.1f' % (x['pl'], x['pp'], x['speed_tg']) for x in map(json.loads, sys.stdin)))")"
        fi
    done
fi
if has pressure; then
    while [[ -f $M/35b-ud.gguf.synthing ]]; do sleep 2; done
    timeout 300 python3 bench/gpu/pressure.py $E $M/35b-ud.gguf > "$O/pressure.log" 2>&1
    echo "pressure: exit $?"; tail -25 "$O/pressure.log"
fi
if has tier; then
    FT=$M/35b-ud.gguf; THREADS=${THREADS:-16}
    while [[ -f $FT.synthing ]]; do sleep 2; done
    if [[ ! -s $FT ]]; then
        t0=$(date +%s)
        $E synth -o $FT.tmp --preset 35b-a3b --quant ud-q4_k_m --seed 0 --skew 1 > "$O/synth-ud.log" 2>&1 && mv $FT.tmp $FT
        echo "synth ud-q4_k_m: $(( $(date +%s) - t0 )) s"
    fi
    wait_llama_build
    rm -rf ~/.cache/ember/heat
    for bn in $(echo "${BUDGETS:-20=6,12=23,8=31}" | tr ',' ' '); do
        b=${bn%=*}; n=${bn#*=}
        for run in cold warm; do
            t0=$(date +%s)
            $E bench -m $FT --device cuda --gpu-mem 0=${b}GiB -c 131072 --kv-type q8_0 -t $THREADS --prompts real \
                -p ${TIER_P:-2048} -n 128 -r 2 -o json > "$O/tier-$b-$run.json" 2> "$O/tier-$b-$run.log"
            echo "ember $b GiB $run: exit $? in $(( $(date +%s) - t0 )) s"
            grep -E "device:|hit rate|tokens/s" "$O/tier-$b-$run.log" | head -12
        done
        rm -rf ~/.cache/ember/heat
        if [[ -x $LB ]]; then
            t0=$(date +%s)
            $LB -m $FT -ngl 99 -ncmoe $n -fa 1 -ctk q8_0 -ctv q8_0 -t $THREADS -p ${TIER_P:-2048} -n 128 -r 2 -o json > "$O/tier-llama-$b.json" 2> "$O/tier-llama-$b.log"
            echo "llama.cpp -ncmoe $n: exit $? in $(( $(date +%s) - t0 )) s"
            python3 -c "import json,sys; [print('  llama', ('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen']), round(x['avg_ts'],1)) for x in json.load(open(sys.argv[1]))]" "$O/tier-llama-$b.json"
        fi
        python3 -c "import json,sys; [print('  ember', ('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen']), round(x['avg_ts'],1), 'hit', x.get('experts') and round(x['experts']['hit_rate'],3)) for x in json.load(open(sys.argv[1]))]" "$O/tier-$b-warm.json"
    done
fi
if has bench; then
    ensure_model
    # ember's first round runs while llama.cpp may still be building; llama.cpp's waits for it.
    for r in $(seq 1 "$ROUNDS"); do
        for eng in ember llama; do
            [[ $eng == llama ]] && wait_llama_build
            t0=$(date +%s)
            if [[ $eng == ember ]]; then
                $E bench -m $F --device cuda -p ${PROMPTS:-512} -n 128 -d 0,$DEPTHS -r 2 -o json > "$O/ember-$r.json" 2> "$O/ember-$r.log"
            elif [[ -x $LB ]]; then
                $LB -m $F -ngl 99 -fa 1 -p ${PROMPTS:-512} -n 128 -d 0,$DEPTHS -r 2 -o json > "$O/llama-$r.json" 2> "$O/llama-$r.log"
            fi
            echo "round $r $eng: exit $? in $(( $(date +%s) - t0 )) s"
        done
    done
    python3 bench/gpu/ratios.py "$O" '(?P<eng>ember|llama)-[0-9]+\.json'
fi
if has cpu; then
    ensure_model; [[ ${LLAMA:-1} == 1 ]] && wait_llama_build
    export CUDA_VISIBLE_DEVICES=
    [[ -x /tmp/bin/bandwidth ]] && /tmp/bin/bandwidth 2048 16 > "$O/cpu-bandwidth.txt" 2>&1 && cat "$O/cpu-bandwidth.txt"
    # CPU_PAIRS=0: no engine pairs (a later call's profile or HTTP part alone).
    [[ ${CPU_PAIRS:-1} == 1 ]] || CPU_THREADS=none
    for t in $(echo "${CPU_THREADS:-16,8}" | tr ',' ' ' | sed 's/none//'); do
        for r in $(seq 1 "$ROUNDS"); do
            $E bench -m $F --device cpu -t $t -p 512 -n 128 -d 0,${CPU_DEPTHS:-4096} -r ${CPU_REPS:-2} -o json > "$O/cpu-ember-t$t-$r.json" 2> "$O/cpu-ember-t$t-$r.log"
            echo "cpu t=$t round $r ember: exit $?"
            if [[ -x $LB ]]; then
                $LB -m $F -ngl 0 -fa 1 -t $t -p 512 -n 128 -d 0,${CPU_DEPTHS:-4096} -r ${CPU_REPS:-2} -o json > "$O/cpu-llama-t$t-$r.json" 2> "$O/cpu-llama-t$t-$r.log"
                echo "cpu t=$t round $r llama.cpp: exit $?"
            fi
        done
    done
    [[ ${CPU_PAIRS:-1} == 1 ]] && python3 bench/gpu/ratios.py "$O" 'cpu-(?P<eng>ember|llama)-t(?P<t>[0-9]+)-[0-9]+\.json'
    # CPU_BF16_AB=1: prompts at depth with P·V in bf16 and in f32 (EMBER_BF16=0), alternating
    # (where the host has AVX-512 BF16; without EMBER_BF16 ember times vdpbf16ps against FMAs
    # once and takes bf16 only at 1.5x: see docs/perf.md v15).
    if [[ ${CPU_BF16_AB:-0} == 1 ]] && grep -q avx512_bf16 /proc/cpuinfo; then
        for r in $(seq 1 "$ROUNDS"); do
            for bf in 1 0; do
                EMBER_BF16=$bf $E bench -m $F --device cpu -t 16 -p 512 -n 0 -d ${CPU_BF16_DEPTH:-8192} -r 2 -o json > "$O/cpu-bf16-$bf-$r.json" 2> "$O/cpu-bf16-$bf-$r.log"
                echo "cpu bf16=$bf round $r: $(python3 -c "import json,sys; print(' '.join('pp%d@d%d %.1f' % (x['n_prompt'], x['n_depth'], x['avg_ts']) for x in json.load(open(sys.argv[1]))))" "$O/cpu-bf16-$bf-$r.json")"
            done
        done
    fi
    # CPU_PROFILE=1 (default): decode's time per op at 16 threads (issue 18 item 3), at depth 0
    # and at the first of CPU_DEPTHS (`model_bench` with EMBER_PROFILE=1, 32 tokens).
    if [[ ${CPU_PROFILE:-1} == 1 && -x /tmp/bin/model_bench ]]; then
        cd0=${CPU_DEPTHS:-4096}
        for d in 0 ${cd0%%,*}; do
            EMBER_PROFILE=1 /tmp/bin/model_bench $F 35b-a3b q4_k_m 0 32 $d 16 > "$O/cpu-profile-d$d.txt" 2>&1
            echo "cpu profile d=$d: exit $?"; head -40 "$O/cpu-profile-d$d.txt"
        done
        # A 512-token prompt's ops at 16 and 8 threads: which ones do not scale (pp512 went
        # 1.50x from 8 threads to 16 on 2026-12-06, llama.cpp 1.69x).
        for t in 16 8; do
            EMBER_PROFILE=1 /tmp/bin/model_bench $F 35b-a3b q4_k_m 512 0 0 $t > "$O/cpu-profile-pp512-t$t.txt" 2>&1
            echo "cpu profile pp512 t=$t: exit $?"; head -30 "$O/cpu-profile-pp512-t$t.txt"
        done
    fi
    if [[ ${CPU_HTTP:-1} == 1 ]]; then
        $E bench -m $F --device cpu -t 16 -p 512 -n 64 -d 0,512 -r 2 -o json > "$O/cpu-http-bench.json" 2> "$O/cpu-http-bench.log"
        $E serve -m $F --device cpu -t 16 --port 8097 --parallel 1 -c 8192 > "$O/cpu-serve.log" 2>&1 & S=$!
        for i in $(seq 1 240); do curl -s http://127.0.0.1:8097/v1/models > /dev/null && break; sleep 1; done
        $E bench-http --url http://127.0.0.1:8097 --depths 512 --n-predict 64 --runs 3 -o json > "$O/cpu-http.json" 2> "$O/cpu-http.log"
        echo "cpu http: exit $?"; kill $S; wait $S 2>/dev/null
        python3 -c "
import json, sys
b = {('pp%d' % x['n_prompt'] if x['n_prompt'] else 'tg%d' % x['n_gen']) + ('@d%d' % x['n_depth'] if x.get('n_depth') else ''): x['avg_ts'] for x in json.load(open(sys.argv[1]))}
h = json.load(open(sys.argv[2]))[0]
print('http prefill %.1f vs pp512 %.1f (%.3f); decode %.2f vs tg64@d512 %.2f (%.3f)' % (h['prefill_ts'], b['pp512'], h['prefill_ts'] / b['pp512'], h['decode_ts'], b['tg64@d512'], h['decode_ts'] / b['tg64@d512']))
" "$O/cpu-http-bench.json" "$O/cpu-http.json"
    fi
fi
