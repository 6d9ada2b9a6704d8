python bench/convergence.py --seed 1 --tag seed1 --out bench/results
