python bench/convergence.py --task transformer --hidden 64 --context 32 --batch 16 --lr-adam 6e-3 --lr-lamb 2e-2 --seed 1 --tag seed1 --out bench/results
