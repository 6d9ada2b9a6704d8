python bench/netsim.py --hosts 4 --rate 1gbit --subnet 10.77.41.0/24 -- python bench/trace_call.py --size 25M
