# before = commit 88b871e in its own checkout and venv (git worktree add --detach /work/wt/before 88b871e;
# /work/venvs/before/bin/pip install -e /work/wt/before), after = e91fe91; two alternating rounds, 1 Gbit/s:
for i in 1 2; do
for v in before after; do
if [ $v = before ]; then d=/work/wt/before; py=/work/venvs/before/bin/python; else d=/work/main; py=python; fi
cd $d
python /work/main/bench/netsim.py --hosts 4 --rate 1gbit --subnet 10.77.41.0/24 -- $py bench/train_step.py --methods ddp_adamw,onebit_adam,onebit_lamb,zeroone_adam --no-baseline -q 2>/dev/null | grep -E "^  " | sed "s/^/$v /"
done; done
