python bench/convergence.py --seed 2 --tag seed2 --out bench/results
