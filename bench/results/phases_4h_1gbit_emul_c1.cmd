python bench/netsim.py --hosts 4 --rate 1gbit --cpus-per-host 1 --subnet 10.77.146.0/24 -- python bench/phases.py --sizes 1M,10M,100M --iters 9 --json bench/results/phases_4h_1gbit_emul_c1.json
