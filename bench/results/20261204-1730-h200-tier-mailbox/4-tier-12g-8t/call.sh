for i in 1 2; do THREADS=8 BUDGETS=12=23 STAGES=tier bash bench/gpu/h200.sh 2>&1 | grep -E "tg128: run|exit|ember tg|llama tg"; done
