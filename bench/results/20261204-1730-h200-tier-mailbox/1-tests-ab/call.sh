LLAMA=0 STAGES=tests SKIP_TESTS=nvrtc_compile SYNTH=0 UD_SYNTH=1 bash bench/gpu/h200.sh
for f in $OUT/test-*.log; do echo "$(basename $f): $(grep -h 'test result' $f | tr '\n' ' ')"; grep -h "FAILED\|panicked" $f | head -5; done
grep -h "mailbox\|bit for bit\|NaN" $OUT/test-mailbox.log $OUT/test-hybrid.log | head -20
E=/tmp/bin/ember; FT=/tmp/m/35b-ud.gguf; export EMBER_KERNEL_CACHE=/tmp/kc
while [[ -f $FT.synthing ]]; do sleep 2; done; ls -la $FT; tail -2 /tmp/m/synth-ud.log
for mb in 1 0; do rm -rf ~/.cache/ember/heat; EMBER_TIER_MAILBOX=$mb timeout 120 $E run -m $FT --device cuda --gpu-mem 0=8GiB -p "The history of the river" -n 64 --temp 0 -t 16 > $OUT/run-8-mb$mb.txt 2> $OUT/run-8-mb$mb.log; echo "run 8 GiB mailbox=$mb exit $?"; done
cmp $OUT/run-8-mb1.txt $OUT/run-8-mb0.txt && echo "8 GiB greedy 64 tokens: mailbox and download forms identical"
for b in 20 8; do
  rm -rf ~/.cache/ember/heat
  timeout 120 $E bench -m $FT --device cuda --gpu-mem 0=${b}GiB -c 131072 --kv-type q8_0 -t 16 --prompts real -p 512 -n 128 -r 1 -o json > $OUT/ab-$b-cold.json 2> $OUT/ab-$b-cold.log; echo "cold $b exit $?"
  for r in 1 2; do for mb in 1 0; do
    t0=$(date +%s)
    EMBER_TIER_MAILBOX=$mb timeout 120 $E bench -m $FT --device cuda --gpu-mem 0=${b}GiB -c 131072 --kv-type q8_0 -t 16 --prompts real -p 512 -n 128 -r 2 -o json > $OUT/ab-$b-mb$mb-$r.json 2> $OUT/ab-$b-mb$mb-$r.log
    echo "$b GiB mailbox=$mb round $r: exit $? in $(( $(date +%s) - t0 )) s"
    python3 -c "import json,sys; [print('  ', ('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen']), round(x['avg_ts'],1), 'hit', x.get('experts') and round(x['experts']['hit_rate'],3)) for x in json.load(open(sys.argv[1]))]" $OUT/ab-$b-mb$mb-$r.json
  done; done
done
ls /tmp/llama/build/bin 2>/dev/null | head; cat /tmp/llama/built 2>/dev/null
