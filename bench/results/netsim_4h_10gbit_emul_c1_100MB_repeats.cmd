# three runs in a row of: python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.125.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 100M -e 100M -n 5 -w 2
python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.125.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 100M -e 100M -n 5 -w 2
# then, at b40d3df (hosts confined), the same three times (runs 4-6), and three times with -b 4M -e 4M
# then, at 5c3369d (2026-11-29, 13:11), the same command four more times (runs 7-10) and four times with -b 4M -e 4M
# then, on 2026-11-29 in a quiet hour (16:34, the collective unchanged since 5c3369d), the same command three more times (runs 11-13)
# and three times with -b 4M -e 4M -n 20 -w 3 (4 MiB runs 5-7; run 5 at 15:29 on --subnet 10.77.161.0/24, runs 6-7 at 16:35):
python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.125.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 4M -e 4M -n 20 -w 3
