#!/usr/bin/env bash
# Call P, at the session's final GPU code (the int8 prompt kernels' mmas issued together,
# attention_mma's lean form): every GPU test binary and serve-check (llama.cpp building, the 35B
# being written), and gpu, matmul, conformance, model with EMBER_Q4K_SHFL (the quad's lanes
# sharing the Q4_K scales by shuffles); the 64-token int8 matmul and its bound, which g17 found
# no gain before the kernels changed, and the switch (base / mm64 / mm64all / mm32all / shfl,
# pp512, pp2048, pp8192, two rounds); issue
# 19's table against llama.cpp with the variant whose prompt figures are best (its switches
# named in the output).
set -uo pipefail
O=${OUT:?}/p; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
( for t in gpu matmul conformance model; do
    EMBER_KERNEL_CACHE=/tmp/kc-shfl EMBER_KERNEL_DEFINES=EMBER_Q4K_SHFL timeout 240 /tmp/bin/$t --test-threads=1 > $O/test-shfl-$t.log 2>&1 &
  done; wait ) &
SW=$!
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
wait $SW
for f in $O/test-shfl-*.log; do echo "$(basename $f): $(grep -E '^test result' $f | tail -1)"; done
R=2; (( SECONDS > 260 )) && R=1
OUT=$O VARIANTS='base:;mm64:EMBER_MATMUL_MMA8_64=1;mm64all:EMBER_MATMUL_MMA8_64=1 EMBER_MATMUL_MMA8_MAX_TOKENS=1000000;mm32all:EMBER_MATMUL_MMA8_MAX_TOKENS=1000000;shfl:EMBER_KERNEL_DEFINES=EMBER_Q4K_SHFL' VARIANT_ARGS='-p 512,2048,8192 -n 0' ROUNDS=$R STAGES=variants timeout $(( 470 - SECONDS )) ./bench/gpu/h200.sh 2>&1 | grep -v '^name\|^NVIDIA'
echo "variants done at $SECONDS s"
BEST=$(python3 - "$O" <<'PY'
import glob, json, math, sys, collections
envs = {'base': '', 'mm64': 'EMBER_MATMUL_MMA8_64=1', 'mm64all': 'EMBER_MATMUL_MMA8_64=1 EMBER_MATMUL_MMA8_MAX_TOKENS=1000000', 'mm32all': 'EMBER_MATMUL_MMA8_MAX_TOKENS=1000000', 'shfl': 'EMBER_KERNEL_DEFINES=EMBER_Q4K_SHFL'}
ts = collections.defaultdict(lambda: collections.defaultdict(list))
for f in glob.glob(sys.argv[1] + '/variant-*.json'):
    name = f.split('variant-')[1].rsplit('-', 1)[0]
    try:
        for x in json.load(open(f)): ts[name][x['n_prompt']].append(x['avg_ts'])
    except Exception: pass
score = {n: math.exp(sum(math.log(sum(v) / len(v)) for v in d.values()) / len(d)) for n, d in ts.items() if len(d) == 3}
for n, s in sorted(score.items(), key=lambda a: -a[1]): print(f'# {n}: geometric mean {s:.1f}', file=sys.stderr)
print(envs.get(max(score, key=score.get), '') if score else '')
PY
)
echo "table with: '${BEST}'"
env $BEST bash -c "OUT=$O ROUNDS=1 PROMPTS=512,8192 DEPTHS=32768 STAGES=bench timeout \$(( 575 - $SECONDS )) ./bench/gpu/h200.sh" 2>&1 | grep -v '^name\|^NVIDIA'
echo "bench done at $SECONDS s"
cp /tmp/llama/build.log $O/ 2>/dev/null
(cd ${OUT} && tar czf p.tgz p && rm -rf p)
