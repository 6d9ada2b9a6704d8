python bench/allreduce_bw.py --min-bytes 1M --max-bytes 100M --factor 10 --iters 2 --warmup 2 --ops compressed,exact --json bench/results/peak_memory_local4.json
