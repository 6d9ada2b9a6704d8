python bench/netsim.py --hosts 4 --rate 1gbit --subnet 10.77.41.0/24 -- python bench/optim_overlap.py --batch 256 --steps 5 --json bench/results/optim_overlap_netsim_4h_1gbit.json
