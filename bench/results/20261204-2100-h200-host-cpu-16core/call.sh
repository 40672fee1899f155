# Call C (untracked): issue 18 on the H200 host's 16 cores, ember only (no device time was left
# for a llama.cpp build): read bandwidth, ember bench at 16 and 8 threads at depths 0 and 4096,
# and the HTTP path at depths 512 and 4096 against in-process.
set -u
O=$OUT; E=/tmp/bin/ember; F=/tmp/m/35b.gguf
STAGES=cpu LLAMA=0 ROUNDS=1 CPU_THREADS=16,8 CPU_DEPTHS=4096 bash bench/gpu/h200.sh
export CUDA_VISIBLE_DEVICES=
$E bench -m $F --device cpu -t 16 -p 0 -n 64 -d 4096 -r 2 -o json > $O/cpu-bench-d4096.json 2> $O/cpu-bench-d4096.log
echo "bench tg64@d4096: exit $?"; grep -E "tg64" $O/cpu-bench-d4096.log | tail -3
$E serve -m $F --device cpu -t 16 --port 8097 --parallel 1 -c 8192 > $O/cpu-serve-4096.log 2>&1 & S=$!
for i in $(seq 1 240); do curl -s http://127.0.0.1:8097/v1/models > /dev/null && break; sleep 1; done
$E bench-http --url http://127.0.0.1:8097 --depths 4096 --n-predict 64 --runs 2 -o json > $O/cpu-http-4096.json 2> $O/cpu-http-4096.log
echo "http d4096: exit $?"; kill $S; wait $S 2>/dev/null
cat $O/cpu-http-4096.json
