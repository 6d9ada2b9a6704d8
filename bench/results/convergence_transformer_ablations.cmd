python bench/convergence_ablations.py --task transformer --hidden 64 --context 32 --batch 16 --lr-adam 6e-3 --lr-lamb 2e-2 --json bench/results/convergence_transformer_ablations.json
