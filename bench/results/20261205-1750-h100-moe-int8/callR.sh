#!/usr/bin/env bash
# Call R (same warm machine as Q): A/B EMBER_MOE_GU_FUSED=0 with the int8 MoE off; the compute
# reserve by step size against the fixed 1.5 GiB (ud-q4_k_m 35B at 12 and 8 GiB; cold run for the
# heat file, then warm runs alternating); then Nsight Compute on the prompt kernels.
set -uo pipefail
O=${OUT:?}; export OUT=$O; export EMBER_KERNEL_CACHE=/tmp/kc
nvidia-smi --query-gpu=name --format=csv,noheader
[[ -x /tmp/bin/ember ]] || tar -C /tmp -xJf .gpu/bin.tar.xz
mkdir -p $O/abf; OUT=$O/abf EMBER_MMA8=0 EMBER_MOE_MMA8=0 LLAMA=0 STAGES=ab ROUNDS=2 AB=EMBER_MOE_GU_FUSED=0 AB_ARGS="-p 512,2048 -n 0" ./bench/gpu/h200.sh 2>&1 | grep "^ab"
(cd $O && tar czf abf.tgz abf && rm -rf abf)
F=/tmp/m/35b-ud.gguf
while [[ -f $F.synthing ]]; do sleep 2; done
[[ -s $F ]] || { /tmp/bin/ember synth -o $F.tmp --preset 35b-a3b --quant ud-q4_k_m --seed 0 --skew 1 > $O/synth-ud.log 2>&1 && mv $F.tmp $F; }
echo "ud model at $SECONDS s"
run() { # budget tag env...
  local b=$1 tag=$2; shift 2
  env "$@" timeout 200 /tmp/bin/ember bench -m $F --device cuda --gpu-mem 0=${b}GiB -c 131072 --kv-type q8_0 -t 16 --prompts real \
      -p 2048 -n 128 -r 2 -o json > $O/tier-$b-$tag.json 2> $O/tier-$b-$tag.log
  echo "$b GiB $tag: exit $? $(grep -o 'the trunk and [0-9]* of [0-9]* routed experts[^;]*' $O/tier-$b-$tag.log | head -1)"
  python3 -c "import json,sys; print('  ', ' '.join(('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen'])+' %.1f'%x['avg_ts']+(' hit %.3f'%x['experts']['hit_rate'] if x.get('experts') else '') for x in json.load(open(sys.argv[1]))))" $O/tier-$b-$tag.json 2>/dev/null
}
for b in 12 8; do
  rm -rf ~/.cache/ember/heat
  run $b cold
  run $b step-1; run $b fixed-1 EMBER_COMPUTE_RESERVE=fixed
  run $b fixed-2 EMBER_COMPUTE_RESERVE=fixed; run $b step-2
  echo "at $SECONDS s"
done
(cd $O && tar czf tier.tgz tier-* && rm -f tier-*)
(( SECONDS < 420 )) && { mkdir -p $O/n; OUT=$O/n LLAMA=0 NCU_COUNT=6 STAGES=ncu timeout $((560 - SECONDS)) ./bench/gpu/h200.sh 2>&1 | tail -50; (cd $O && tar czf n.tgz n && rm -rf n); }
echo "done at $SECONDS s"
