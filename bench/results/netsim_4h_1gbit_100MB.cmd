python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/allreduce_bw.py --backend gloo --min-bytes 100M --max-bytes 100M --iters 5 --warmup 2 --json bench/results/netsim_4h_1gbit_100MB.json
