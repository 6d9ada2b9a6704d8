python bench/soak.py --calls 10000 --json bench/results/soak.json
