python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/train_step.py --json bench/results/train_step_netsim_4h_1gbit_merged.json --plot bench/results/train_step_netsim_4h_1gbit_merged.png -q
