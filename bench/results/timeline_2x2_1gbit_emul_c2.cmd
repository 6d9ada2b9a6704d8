python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 1gbit --cpus-per-host 2 --subnet 10.77.151.0/24 -- python bench/timeline.py --size 100M --calls 7 --warmup 2 --json bench/results/timeline_2x2_1gbit_emul_c2.json --png bench/results/timeline_2x2_1gbit_emul_c2.png
# the .png redrawn from the .json after the link lanes' drawing changed (same data):
python -c "import json, sys; sys.path.insert(0, 'bench'); import timeline; d = json.load(open('bench/results/timeline_2x2_1gbit_emul_c2.json')); timeline.draw(d['calls'], 'bench/results/timeline_2x2_1gbit_emul_c2.png', d['meta'])"
