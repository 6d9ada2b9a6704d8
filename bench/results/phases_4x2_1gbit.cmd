python bench/netsim.py --hosts 4 --ranks-per-host 2 --rate 1gbit --subnet 10.77.13.0/24 -- python bench/phases.py --sizes 1M,100M --iters 3 --json bench/results/phases_4x2_1gbit.json
