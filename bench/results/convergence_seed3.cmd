python bench/convergence.py --seed 3 --tag seed3 --out bench/results
