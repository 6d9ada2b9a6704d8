python bench/convergence.py
