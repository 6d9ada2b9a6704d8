python bench/convergence.py --out bench/results
