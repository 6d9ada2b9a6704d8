python bench/allreduce_bw.py --backend gloo --json bench/results/local4_gloo.json
