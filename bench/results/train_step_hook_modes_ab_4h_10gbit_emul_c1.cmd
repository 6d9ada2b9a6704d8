# bench/results/train_step_hook_modes_ab_4h_10gbit_emul_c1.txt: two worktrees, before (d3c96f9, PYTHONPATH=<its checkout>) and after (2440842), alternated:
for round in 1 2; do for side in before after; do
  python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.61.0/24 -- \
    python bench/train_step.py --methods ddp_sgd_onebit,ddp_sgd_onebit_propagate,onebit_adam --steps 45 --json ${side}_${round}.json -q
done; done
