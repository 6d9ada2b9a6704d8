python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.144.0/24 -- python bench/train_step.py -q --json bench/results/train_step_netsim_4h_10gbit_emul_c1.json
