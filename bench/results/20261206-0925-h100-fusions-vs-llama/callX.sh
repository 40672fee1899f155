#!/usr/bin/env bash
# Call X: every GPU test binary + serve-check at the final tree (the L2 hint removed, the fused
# prep for one-token steps only), then tg128 and 16 sequences at depth 4096, two rounds.
set -uo pipefail
O=${OUT:?}; mkdir -p $O/x
OUT=$O/x LLAMA=0 SKIP_TESTS=nvrtc_compile STAGES=tests,serve ./bench/gpu/h200.sh
echo "tests+serve done at $SECONDS s"
export EMBER_KERNEL_CACHE=/tmp/kc
for r in 1 2; do
  timeout 60 /tmp/bin/ember bench -m /tmp/m/35b.gguf --device cuda -p 0 -n 128 -r 2 -o json > $O/x/tg-$r.json 2> $O/x/tg-$r.log
  timeout 60 /tmp/bin/ember bench -m /tmp/m/35b.gguf --device cuda --n-seq 16 -p 0 -n 128 -d 4096 -r 1 -o json > $O/x/b16-$r.json 2> $O/x/b16-$r.log
  echo "round $r: $(python3 -c "import json,sys; print([round(x['avg_ts'],1) for f in sys.argv[1:] for x in json.load(open(f))])" $O/x/tg-$r.json $O/x/b16-$r.json) at $SECONDS s"
done
(cd $O && tar czf x.tgz x && rm -rf x)
