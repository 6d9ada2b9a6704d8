python bench/intra_bw.py --nprocs 4 --sizes 4K,1M,16M,100M --iters 10 --warmup 2 --json bench/results/hier_shm_intra_bw_4ranks.json
