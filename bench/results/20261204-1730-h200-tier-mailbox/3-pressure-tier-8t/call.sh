STAGES=pressure bash bench/gpu/h200.sh
THREADS=8 STAGES=tier bash bench/gpu/h200.sh
