python bench/netsim.py --hosts 4 --rate 1gbit --subnet 10.77.51.0/24 -- python bench/phases.py --sizes 25M,100M --iters 5 --json bench/results/phases_4h_1gbit_rerun.json
