E=/tmp/bin/ember; FT=/tmp/m/35b-ud.gguf; export EMBER_KERNEL_CACHE=/tmp/kc
# the llama.cpp build and the ud synth start in their own sessions (tests: only ember is here)
STAGES=tests SYNTH=0 UD_SYNTH=1 bash bench/gpu/h200.sh
while [[ -f $FT.synthing ]]; do sleep 2; done; ls -la $FT
for v in "1 cpu a" "0 cpu a" "1 cpu b" "1 auto a" "0 auto a" "0 auto b"; do set -- $v
  rm -rf ~/.cache/ember/heat
  EMBER_TIER_MAILBOX=$1 EMBER_TIER_PROMPT_MISSES=$2 timeout 120 $E run -m $FT --device cuda --gpu-mem 0=8GiB -p "The history of the river" -n 64 --temp 0 -t 16 > $OUT/run-$1-$2-$3.txt 2> $OUT/run-$1-$2-$3.log; echo "run mailbox=$1 prompt-misses=$2 ($3): exit $? $(md5sum < $OUT/run-$1-$2-$3.txt)"
done
STAGES=tier bash bench/gpu/h200.sh
