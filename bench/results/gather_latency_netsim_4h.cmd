for rate in 1gbit 10gbit; do python bench/netsim.py --hosts 4 --rate $rate --subnet 10.77.41.0/24 -- python -W ignore bench/gather_latency.py 2>/dev/null | grep -v "^\[W"; done
