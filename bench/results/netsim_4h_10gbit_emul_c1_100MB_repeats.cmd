# three runs in a row of: python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.125.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 100M -e 100M -n 5 -w 2
python bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1 --subnet 10.77.125.0/24 -- python bench/allreduce_bw.py --backend gloo -q -b 100M -e 100M -n 5 -w 2
# then, at b40d3df (hosts confined), the same three times (runs 4-6), and three times with -b 4M -e 4M
# then, at 5c3369d (2026-11-29, 13:11), the same command four more times (runs 7-10) and four times with -b 4M -e 4M
