python bench/netsim.py --hosts 4 --rate 10gbit -- python bench/train_step.py --json bench/results/train_step_netsim_4h_10gbit.json --plot bench/results/train_step_netsim_4h_10gbit.png -q
