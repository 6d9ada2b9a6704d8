python bench/convergence.py --seed 2 --runs diloco_h16 --lr-diloco 4e-3 --outer-lr 1.0 --outer-momentum 0.5 --diloco-bucket-kb 1 --diloco-passes 2 --diloco-passes-until 300 --tag diloco_inner_seed2
