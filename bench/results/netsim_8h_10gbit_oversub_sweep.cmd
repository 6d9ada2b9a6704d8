python bench/netsim.py --hosts 8 --rate 10gbit --subnet 10.77.136.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 4M -e 4M -n 5 -w 2 --json bench/results/netsim_8h_10gbit_oversub_sweep.json
