#!/usr/bin/env bash
# End to end on the GPU machine with the release binary: inspect, logits GPU vs CPU exact,
# greedy run, serve (streamed = non-streamed), bench on small and 35B-A3B synthetic files.
set -uo pipefail
gunzip -kf .gpu/ember.gz; E=./.gpu/ember
F=tests/fixtures/tiny-a/gguf
O=${OUT:-/tmp/out}
mkdir -p $O /tmp/m
export EMBER_KERNEL_CACHE=/tmp/kc
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
echo "== inspect"; $E inspect -m $F/tiny-a-Q4_K_M.gguf | head -4
( $E synth -o /tmp/m/35b.gguf --preset 35b-a3b --quant q4_k_m --seed 0 --skew 1 > $O/synth35.log 2>&1; echo synth35 done ) &
SYN=$!
echo "== logits: GPU vs CPU exact, every fixture, prompt 24 + 8 decode"
toks=$(python3 -c "print(','.join(str((i*37+11)%600) for i in range(32)))")
for q in BF16 Q8_0 Q6_K Q4_K_M; do
  $E logits -m $F/tiny-a-$q.gguf --tokens $toks --prefill 24 --device cuda -o /tmp/g-$q.st 2>>$O/logits.log || echo "gpu logits $q FAILED"
  $E logits -m $F/tiny-a-$q.gguf --tokens $toks --prefill 24 --device cpu --exact -o /tmp/c-$q.st 2>>$O/logits.log
  $E logits -m $F/tiny-a-$q.gguf --tokens $toks --device cuda -o /tmp/g1-$q.st 2>>$O/logits.log
  python3 - $q <<'PY'
import sys, numpy as np, json, struct
def load(p):
    b=open(p,'rb').read(); n=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+n]); t=h['logits']
    a=np.frombuffer(b[8+n+t['data_offsets'][0]:8+n+t['data_offsets'][1]],dtype=np.float32).reshape(t['shape']); return a
q=sys.argv[1]; g=load(f'/tmp/g-{q}.st'); c=load(f'/tmp/c-{q}.st'); g1=load(f'/tmp/g1-{q}.st')
rel=np.abs(g-c).max(axis=1)/np.abs(c).max(axis=1)
top=(g.argmax(1)==c.argmax(1)).mean()
print(f"{q}: GPU vs CPU exact: max rel per position {rel.max():.2e} (median {np.median(rel):.2e}), top-1 agree {top:.3f}; prompt-all vs prompt+decode on GPU max rel {(np.abs(g-g1).max(axis=1)/np.abs(g1).max(axis=1)).max():.2e}")
PY
done
echo "== run greedy, GPU and CPU"
$E run -m $F/tiny-a-Q8_0.gguf -p "Hello there" -n 24 --temp 0 --device cuda 2>$O/run-gpu.log | tee /tmp/run-gpu.txt; echo
$E run -m $F/tiny-a-Q8_0.gguf -p "Hello there" -n 24 --temp 0 --device cpu 2>$O/run-cpu.log | tee /tmp/run-cpu.txt; echo
tail -2 $O/run-gpu.log
echo "== serve --device cuda"
$E serve -m $F/tiny-a-Q8_0.gguf --device cuda --port 8181 --parallel 4 --cache-ram 64 > $O/serve.log 2>&1 &
SP=$!
for i in $(seq 1 60); do curl -sf localhost:8181/health >/dev/null && break; sleep 0.5; done
req='{"messages":[{"role":"user","content":"Write a story"}],"max_tokens":40,"temperature":0}'
curl -s localhost:8181/v1/chat/completions -d "$req" | python3 -c "import json,sys; print('non-stream:', repr(json.load(sys.stdin)['choices'][0]['message']))" > /tmp/ns.txt; cat /tmp/ns.txt
curl -sN localhost:8181/v1/chat/completions -d "${req%?},\"stream\":true}" | python3 -c "
import json,sys
c='';r=''
for l in sys.stdin:
    l=l.strip()
    if l.startswith('data: ') and l!='data: [DONE]':
        d=json.loads(l[6:])['choices'][0]['delta']; c+=d.get('content') or ''; r+=d.get('reasoning_content') or ''
print('stream: content', repr(c), 'reasoning', repr(r))"
for i in 1 2 3 4; do curl -s localhost:8181/v1/completions -d '{"prompt":"Once upon a time '$i'","max_tokens":30}' -o /tmp/c$i.json & done; wait
python3 -c "import json; print('4 parallel completions:', [len(json.load(open(f'/tmp/c{i}.json'))['choices'][0]['text']) for i in range(1,5)])"
curl -s localhost:8181/metrics | grep -E "kv_pages|prompt_cache_(hits|entries)" 
kill $SP; wait $SP 2>/dev/null
echo "== bench small (synth) GPU vs CPU 16 threads"
$E synth -o /tmp/m/small.gguf --preset small --quant q4_k_m --seed 0 --skew 1 > $O/synth-small.log 2>&1
$E bench -m /tmp/m/small.gguf --device cuda -p 512 -n 128 -r 3 2>$O/bench-small-gpu.log | tee $O/bench-small-gpu.md
$E bench -m /tmp/m/small.gguf --device cpu -t 16 -p 512 -n 128 -r 2 2>$O/bench-small-cpu.log | tee $O/bench-small-cpu.md
wait $SYN; cat $O/synth35.log | tail -2
echo "== bench 35B-A3B GPU"
( time $E bench -m /tmp/m/35b.gguf --device cuda -p 512 -n 128 -r 2 ) 2>$O/bench-35b-gpu.log | tee $O/bench-35b-gpu.md
tail -5 $O/bench-35b-gpu.log
nvidia-smi --query-gpu=memory.used --format=csv
