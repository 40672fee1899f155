LLAMA=0 STAGES=tests SYNTH=0 UD_SYNTH=1 SKIP_TESTS=nvrtc_compile,attention,conformance,delta_rule,gemv_q8,gpu,model,references bash bench/gpu/h200.sh
for f in $OUT/test-*.log; do echo "$(basename $f): $(grep -h 'test result' $f | tr '\n' ' ')"; grep -h "FAILED\|panicked" $f | head -5; done
grep -h "copy stream\|bit for bit" $OUT/test-hybrid.log | head
E=/tmp/bin/ember; FT=/tmp/m/35b-ud.gguf; export EMBER_KERNEL_CACHE=/tmp/kc
while [[ -f $FT.synthing ]]; do sleep 2; done; ls -la $FT
for b in 12 20; do
  rm -rf ~/.cache/ember/heat
  timeout 60 $E bench -m $FT --device cuda --gpu-mem 0=${b}GiB -c 131072 --kv-type q8_0 -t 8 --prompts real -p 512 -n 128 -r 1 -o json > $OUT/ab-$b-cold.json 2> $OUT/ab-$b-cold.log; echo "cold $b exit $?"
  for r in 1 2; do for a in 1 0; do
    EMBER_TIER_ASYNC_UPLOADS=$a timeout 60 $E bench -m $FT --device cuda --gpu-mem 0=${b}GiB -c 131072 --kv-type q8_0 -t 8 --prompts real -p 512 -n 128 -r 2 -o json > $OUT/ab-$b-a$a-$r.json 2> $OUT/ab-$b-a$a-$r.log
    echo "$b GiB async=$a round $r: exit $?"
    python3 -c "import json,sys; [print('  ', ('pp%d'%x['n_prompt'] if x['n_prompt'] else 'tg%d'%x['n_gen']), round(x['avg_ts'],1), [round(v,1) for v in x['samples_ts']], 'hit', x.get('experts') and round(x['experts']['hit_rate'],3)) for x in json.load(open(sys.argv[1]))]" $OUT/ab-$b-a$a-$r.json
    grep -h "tier uploads" $OUT/ab-$b-a$a-$r.log | grep tg128 | sed 's/.*), //'
  done; done
done
