# before = commit 3cf3053 (phase 2 of small calls through gloo's ring all-gather) in its own checkout and venv
# (git worktree add --detach /work/wt/before 3cf3053; /work/venvs/before/bin/pip install -e /work/wt/before),
# after = e92f247 (an all-to-all of n copies up to 128 KiB); three alternating rounds at 10 Gbit/s, one at 1 Gbit/s:
for rate in 10gbit 10gbit 10gbit 1gbit; do
for v in after before; do
if [ $v = before ]; then d=/work/wt/before; py=/work/venvs/before/bin/python; else d=/work/main; py=python; fi
cd $d; echo "== $rate, $v"
python /work/main/bench/netsim.py --hosts 4 --rate $rate --subnet 10.77.41.0/24 -- $py bench/allreduce_bw.py --backend gloo --min-bytes 1M --max-bytes 4M --factor 2 --iters 10 --warmup 3 -q 2>/dev/null | grep -E "float32|speedup  "
done; done
