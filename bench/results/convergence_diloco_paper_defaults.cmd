python bench/convergence.py --runs diloco_exact_h16,diloco_h16 --tag diloco_paper_defaults --out bench/results
