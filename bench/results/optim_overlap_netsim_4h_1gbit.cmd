python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/optim_overlap.py --batch 256 --steps 5 --json bench/results/optim_overlap_netsim_4h_1gbit.json
