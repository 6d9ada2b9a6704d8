# before = commit fb5b6a4 in its own checkout and venv (git worktree add --detach /work/wt/before fb5b6a4;
# /work/venvs/before/bin/pip install -e /work/wt/before), after = 0fbab56 (non-temporal stores); two alternating rounds, 1 Gbit/s:
for i in 1 2; do
for v in before after; do
if [ $v = before ]; then d=/work/wt/before; py=/work/venvs/before/bin/python; else d=/work/main; py=python; fi
cd $d
python /work/main/bench/netsim.py --hosts 4 --rate 1gbit --subnet 10.77.51.0/24 -- $py bench/train_step.py --methods ddp_adamw,onebit_adam,onebit_lamb,zeroone_adam --no-baseline -q 2>/dev/null | grep -E "^  " | sed "s/^/$v /"
done; done
