# 2026-11-29 15:28, library at cbf7575 (the collective as at 5c3369d); the per-phase timeline of the 4 MiB call the 1.2x target is about
python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.160.0/24 -- python bench/timeline.py --size 4M --calls 9 --warmup 3 --json bench/results/timeline_4h_10gbit_emul_c1_4MB.json
