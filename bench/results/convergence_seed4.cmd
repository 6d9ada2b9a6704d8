python bench/convergence.py --seed 4 --tag seed4 --out bench/results
