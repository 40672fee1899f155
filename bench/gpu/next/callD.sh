#!/usr/bin/env bash
# Call d (2026-12-06 night, little device time left): every GPU test binary and serve-check with
# the norm tails (LLAMA=1 builds llama.cpp meanwhile), the tails' own test with its printed
# error, then tg128 and pp512 against llama.cpp alternating (ember with the tails, ember without
# them: EMBER_NORM_TAIL=0, llama.cpp), rounds while the time lasts.
# Run from the repo root with .gpu carried (bench/gpu/pack.sh); LIMIT = the call's limit_s.
set -uo pipefail
L=${LIMIT:-600}
O=${OUT:?}/d; mkdir -p $O
export EMBER_KERNEL_CACHE=/tmp/kc
tar -C /tmp -xJf .gpu/bin.tar.xz
OUT=$O LLAMA=1 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
/tmp/bin/gemv_q8 --test-threads=1 --nocapture norm_tails 2>&1 | grep -E "norm tails|panicked|test result" | tee $O/norm-tails.log
while [[ -f /tmp/llama/building ]] && (( SECONDS < L - 60 )); do sleep 2; done
cp /tmp/llama/build.log $O/ 2>/dev/null
E=/tmp/bin/ember; F=/tmp/m/35b.gguf; LB=/tmp/llama/build/bin/llama-bench
j() { python3 -c "import json,sys; print(' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+' %.1f'%x['avg_ts'] for x in json.load(open(sys.argv[1]))))" "$1" 2>/dev/null; }
for r in 1 2 3; do
  (( SECONDS < L - 45 )) || break
  $E bench -m $F --device cuda -p 512 -n 128 -r 2 -o json > $O/ember-$r.json 2> $O/ember-$r.log; echo "round $r ember: $(j $O/ember-$r.json) at $SECONDS s"
  EMBER_NORM_TAIL=0 $E bench -m $F --device cuda -p 512 -n 128 -r 2 -o json > $O/notail-$r.json 2> $O/notail-$r.log; echo "round $r ember EMBER_NORM_TAIL=0: $(j $O/notail-$r.json) at $SECONDS s"
  [[ -x $LB ]] && { $LB -m $F -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o json > $O/llama-$r.json 2> $O/llama-$r.log; echo "round $r llama.cpp: $(j $O/llama-$r.json) at $SECONDS s"; }
done
(cd ${OUT} && tar czf d.tgz d && rm -rf d)
