python bench/netsim.py --hosts 4 --rate 10gbit --subnet 10.77.51.0/24 -- python bench/trace_call.py --size 100M
