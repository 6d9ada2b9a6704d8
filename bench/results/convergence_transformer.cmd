python bench/convergence.py --task transformer --hidden 64 --context 32 --batch 16
