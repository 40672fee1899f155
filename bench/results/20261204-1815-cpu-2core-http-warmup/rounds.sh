#!/usr/bin/env bash
# Three rounds: ember bench in process, ember serve + bench-http with the defaults ("warm"), and
# again with the extra serve arguments given (TAG), e.g.
#   rounds.sh OUT cold --warm-up 0      (folders 2, 3)
#   rounds.sh OUT nocache --cache-ram 0 (folders 4, 5, 6)
E=${EMBER:-/work/main/target/release/ember}; M=$HOME/.cache/ember/synth/small-q4_k_m-seed0-skew1.gguf; O=${1:?output folder}; TAG=${2:?tag of the second server}; shift 2
cp $E $O/ember-bin; E=$O/ember-bin
serve_http() { # $1 tag, rest: serve args
  local tag=$1; shift
  local t0=$(date +%s.%N)
  $E serve -m $M --device cpu -t 2 --port 8097 --parallel 1 -c 8192 "$@" > $O/serve-$tag.log 2>&1 & S=$!
  for i in $(seq 1 120); do curl -s http://127.0.0.1:8097/v1/models > /dev/null && break; sleep 0.5; done
  echo "$tag: ready after $(echo "$(date +%s.%N) - $t0" | bc) s"
  $E bench-http --url http://127.0.0.1:8097 --depths 512 --n-predict 64 --runs 3 -o json > $O/http-$tag.json 2> $O/http-$tag.log
  kill $S; wait $S 2>/dev/null
}
for r in 1 2 3; do
  uptime > $O/load-$r.txt
  $E bench -m $M --device cpu -t 2 -p 512 -n 64 -d 0,512 -r 3 -o json > $O/bench-$r.json 2> $O/bench-$r.log
  echo "round $r bench exit $?"
  serve_http warm-$r
  serve_http $TAG-$r "$@"
done
echo done
