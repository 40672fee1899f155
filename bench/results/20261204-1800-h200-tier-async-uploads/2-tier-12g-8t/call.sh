for i in 1 2; do LLAMA=0 THREADS=8 BUDGETS=12=23 STAGES=tier bash bench/gpu/h200.sh 2>&1 | grep -E "tg128: run|tg128: expert|exit"; done
