python bench/intra_bw.py --nprocs 2 --sizes 4K,1M,16M,100M --iters 10 --warmup 2 --json bench/results/hier_shm_intra_bw_2ranks.json
# run twice; the first run's table, on a busier machine, is in the .txt below the second's
