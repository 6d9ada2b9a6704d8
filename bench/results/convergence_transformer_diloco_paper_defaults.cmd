python bench/convergence.py --task transformer --hidden 64 --context 32 --batch 16 --lr-adam 6e-3 --lr-lamb 2e-2 --runs diloco_exact_h16,diloco_h16 --tag diloco_paper_defaults --out bench/results
