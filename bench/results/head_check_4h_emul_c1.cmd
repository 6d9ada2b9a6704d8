# 1. at HEAD, for (H, R) in (4, 1gbit), (8, 1gbit), (4, 10gbit):
python bench/netsim.py --hosts H --rate R --cpus-per-host 1 --subnet 10.77.121.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 100M -e 100M -n 5 -w 2
# 2. 3dafe13 against HEAD, alternated (run from /work/main as root):
git worktree add /tmp/wt_old 3dafe13 && (cd /tmp/wt_old && python setup.py build_ext --inplace)
cp -a "$VIRTUAL_ENV" /tmp/venv_old && /tmp/venv_old/bin/python -m pip install --no-build-isolation --no-deps -e /tmp/wt_old
for round in 1 2 3; do for which in old new; do
  if [ $which = old ]; then dir=/tmp/wt_old; venv=/tmp/venv_old; else dir=$PWD; venv=$VIRTUAL_ENV; fi
  (cd $dir && PATH=$venv/bin:$PATH python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.121.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 100M -e 100M -n 5 -w 2)
done; done
# the machine's speed: COMPCOMM_BENCH_ROUNDS=9 COMPCOMM_BENCH_THREADS=1 COMPCOMM_BENCH_DTYPES=float32 COMPCOMM_BENCH_ISAS=avx512 pytest bench/test_codec_speed.py
