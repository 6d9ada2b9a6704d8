#!/usr/bin/env bash
# Issue 25: the collective and a training step before (0efde57) and after the refactor, alternately, two rounds.
set -u
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then tree=/work/wt-before; py=/work/venv-before/bin/python; else tree=/work/main; py=/work/venv/bin/python; fi
    echo "=== round $round: $side ($(git -C $tree rev-parse --short HEAD))"
    (cd $tree && $py bench/allreduce_bw.py --min-bytes 1M --max-bytes 64M --factor 8 --iters 10 --warmup 3 2>&1 | grep -E "^ *[0-9]+ " )
    (cd $tree && $py bench/train_step.py --methods onebit_adam,ddp_sgd_onebit --steps 12 --warmup-steps 4 --no-baseline -q 2>&1 | tail -4)
  done
done
