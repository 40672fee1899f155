#!/usr/bin/env bash
E=/work/main/target/release/ember; M=$HOME/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf; O=/tmp/http
cp $E $O/ember-bin; E=$O/ember-bin
for r in 1 2 3 4; do
  uptime > $O/load-$r.txt
  $E bench -m $M --device cpu -t 2 -p 512 -n 64 -d 0,512 -r 3 -o json > $O/bench-$r.json 2> $O/bench-$r.log
  echo "round $r bench exit $?"
  $E serve -m $M --device cpu -t 2 --port 8097 --parallel 1 -c 8192 > $O/serve-$r.log 2>&1 & S=$!
  for i in $(seq 1 60); do curl -s http://127.0.0.1:8097/v1/models > /dev/null && break; sleep 1; done
  $E bench-http --url http://127.0.0.1:8097 --depths 512 --n-predict 64 --runs 3 -o json > $O/http-$r.json 2> $O/http-$r.log
  echo "round $r http exit $?"
  kill $S; wait $S 2>/dev/null
done
echo done
