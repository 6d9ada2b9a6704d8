python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 1gbit --subnet 10.77.13.0/24 -- python bench/hier_error.py --size 100M --calls 30 --json bench/results/hier_error_2x2_1gbit_100MB.json
