python bench/netsim.py --hosts 4 --rate 10gbit -- python bench/train_step.py --compute-heavy --json bench/results/train_step_netsim_4h_10gbit_compute_heavy.json -q
