#!/usr/bin/env bash
# Call G: gemv_q8_norm (EMBER_NORM_GEMV=1) at d9e0e54: its bits test, the model / conformance /
# hybrid tests with it on and off (the model's loop now adds the MoE output with the next
# layer's input norm), 32 greedy tokens of the 35B on / off, then tg128 on / off, three rounds.
set -uo pipefail
O=${OUT:?}/g; mkdir -p $O /tmp/m
tar -C /tmp -xJf .gpu/bin.tar.xz
export EMBER_KERNEL_CACHE=/tmp/kc
nvidia-smi --query-gpu=name,driver_version --format=csv > $O/gpu.txt
(/tmp/bin/ember synth -o /tmp/m/35b.gguf --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth.log 2>&1; echo "synth: exit $? at $SECONDS s") &
timeout 120 /tmp/bin/gemv_q8 --test-threads=1 --nocapture gemv_q8_norm > $O/test-gemv_q8-norm.log 2>&1; echo "gemv_q8 norm: exit $? $(grep '^test result' $O/test-gemv_q8-norm.log)"
for t in model conformance hybrid; do
  for on in 1 0; do
    EMBER_NORM_GEMV=$on timeout 120 /tmp/bin/$t --test-threads=1 > $O/test-$t-$on.log 2>&1
    echo "$t norm_gemv=$on: exit $? $(grep '^test result' $O/test-$t-$on.log | tail -1)"
  done
done
wait
for on in 0 1; do
  EMBER_NORM_GEMV=$on timeout 60 /tmp/bin/ember run -m /tmp/m/35b.gguf --device cuda -p "The history of the printing press begins" -n 32 --temp 0 --ignore-eos > $O/run-$on.txt 2> $O/run-$on.log
  echo "run norm_gemv=$on: exit $? $(md5sum < $O/run-$on.txt)"
done
for r in 1 2 3; do
  for on in 0 1; do
    EMBER_NORM_GEMV=$on timeout 40 /tmp/bin/ember bench -m /tmp/m/35b.gguf --device cuda -p 0 -n 128 -r 2 -o json > $O/tg-$on-$r.json 2> $O/tg-$on-$r.log
    echo "tg128 norm_gemv=$on round $r: exit $? $(python3 -c "import json,sys; print([round(x['avg_ts'],1) for x in json.load(open(sys.argv[1]))])" $O/tg-$on-$r.json 2>/dev/null)"
  done
  (( SECONDS > 190 )) && break
done
echo "done at $SECONDS s"
