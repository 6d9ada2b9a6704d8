# commit d75dc8e (the collective as of 0fbab56), on another day than netsim_4h_large_streaming.*: two rounds
for round in 1 2; do for r in 1gbit 10gbit; do
  python bench/netsim.py --hosts 4 --rate $r --subnet 10.77.51.0/24 -- python bench/allreduce_bw.py --backend gloo --min-bytes 25M --max-bytes 100M --factor 4 --iters 5 --warmup 2
done; done
