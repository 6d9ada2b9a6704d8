python bench/convergence.py --runs adam,diloco_exact_h8,diloco_h8,diloco_exact_h16,diloco_h16,diloco_exact_h32,diloco_h32 --outer-lr 1.0 --outer-momentum 0.5 --diloco-bucket-kb 1 --tag diloco
