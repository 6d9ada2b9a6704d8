# before = commit fb5b6a4 (plain stores) in its own checkout and venv
# (git worktree add --detach /work/wt/before fb5b6a4; /work/venvs/before/bin/pip install -e /work/wt/before),
# after = 0fbab56 (large decodes and error updates into another buffer with non-temporal stores);
# two alternating rounds at 1 and 10 Gbit/s (the script that ran: /tmp/w/ab.sh, reproduced here):
for round in 1 2; do for rate in 1gbit 10gbit; do for side in before after; do
if [ $side = before ]; then dir=/work/wt/before; py=/work/venvs/before/bin; else dir=/work/main; py=$(dirname $(command -v python)); fi
(cd $dir && PATH=$py:$PATH python bench/netsim.py --hosts 4 --rate $rate --subnet 10.77.51.0/24 -- python bench/allreduce_bw.py --backend gloo --min-bytes 25M --max-bytes 100M --factor 4 --iters 5 --warmup 2 --json ${side}_${rate}_r${round}.json -q > ${side}_${rate}_r${round}.txt 2>&1)
done; done; done
