python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 1gbit --subnet 10.77.13.0/24 -- python bench/phases.py --sizes 1M,10M,100M --iters 3 --json bench/results/phases_2x2_1gbit.json
