# Call B (untracked): the tier against llama.cpp with the fused mailbox, and the fused/separate A/B.
set -u
O=$OUT; E=/tmp/bin/ember; FT=/tmp/m/35b-ud.gguf
STAGES=tier BUDGETS=20=6,12=23 THREADS=16 UD_SYNTH=0 bash bench/gpu/h200.sh
mkdir -p $O/t8; OUT=$O/t8 STAGES=tier BUDGETS=20=6 THREADS=8 bash bench/gpu/h200.sh
# fused (1) / separate (0) mailbox, 20 GiB, 16 threads, from the heat file of one cold run
rm -rf ~/.cache/ember/heat
$E bench -m $FT --device cuda --gpu-mem 0=20GiB -c 131072 --kv-type q8_0 -t 16 --prompts real -p 512 -n 128 -r 1 > /dev/null 2>&1
for r in 1 2; do for v in 1 0; do
  EMBER_TIER_FUSED=$v $E bench -m $FT --device cuda --gpu-mem 0=20GiB -c 131072 --kv-type q8_0 -t 16 --prompts real -p 512 -n 128 -r 2 -o json > $O/ab-$v-$r.json 2> $O/ab-$v-$r.log
  echo "fused=$v round $r: exit $? $(grep -E 'tg128: run|hit rate' $O/ab-$v-$r.log | tr '\n' ' ')"
done; done
