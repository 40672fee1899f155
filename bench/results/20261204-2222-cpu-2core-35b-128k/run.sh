#!/bin/bash
# Issue 18 item 5 on the 2-core VM: the full-size 35B-A3B, 128k context, q8_0 KV, a 100k-token prompt.
M35=~/.cache/ember/synth/35b-a3b-q4_k_m-seed0-skew1.gguf
cd /work/runs/ctx128k
date -u +%FT%TZ > start.txt
free -b > free-before.txt
./ember serve -m $M35 --device cpu -t 2 --port 8098 -c 131072 --kv-type q8_0 --parallel 1 --cache-ram 256 > serve.log 2>&1 &
SP=$!
for i in $(seq 600); do curl -sf localhost:8098/v1/models > models.json && break; sleep 1; done
date -u +%FT%TZ > ready.txt
./ember bench-http --url http://127.0.0.1:8098 --depths 100000 --n-predict 32 --runs 1 --timeout 14400 -o json > http.json 2> http.log
echo "bench-http rc $?" >> http.log
curl -s localhost:8098/metrics > metrics.txt
grep -E "VmHWM|VmRSS" /proc/$SP/status > rss.txt
kill -INT $SP; wait $SP
date -u +%FT%TZ > end.txt
