# Does a quota with no slack (hosts x C = this machine's cores, the default d) distort the
# emulation? The same emulated cluster run at several dilations: a faithful emulation gives the
# same emulated times at every d. 2 hosts: pinned (the reference), d = 1 (quota of a whole core
# per host, no slack) and d = 2 (half a core, half the machine idle); 4 hosts: d = 2 (the
# default, no slack), 3 and 4 (--dilate). 100 MiB fp32 at 10 Gbit/s, where the call is CPU-bound.
# Run from the repository root as root, with python the project's environment, commit 3dafe13;
# each run holds the machine alone (flock -x). Table: netsim_slack_check.txt.
OUT=${OUT:-/tmp/netsim_slack_check}; mkdir -p "$OUT"
BW="python bench/allreduce_bw.py --backend gloo -b 100M -e 100M -n 5 -w 2 -q"
run() {  # name hosts rate netsim-options...
  flock -x /tmp/compcomm-cpu.lock python bench/netsim.py --hosts $2 --rate $3 "${@:4}" --subnet 10.77.201.0/24 \
    --tag slk -- $BW --json "$OUT/$1.json" 2>&1 | grep -v '^\[W' > "$OUT/$1.log"
}
for round in 1 2; do
  run 2h_10g_pin_r$round 2 10gbit --cpus-per-host 1 --pin
  run 2h_10g_d1_r$round 2 10gbit --cpus-per-host 1
  run 2h_10g_d2_r$round 2 10gbit --cpus-per-host 1 --dilate 2
  run 4h_10g_d2_r$round 4 10gbit --cpus-per-host 1
  run 4h_10g_d3_r$round 4 10gbit --cpus-per-host 1 --dilate 3
  run 4h_10g_d4_r$round 4 10gbit --cpus-per-host 1 --dilate 4
done
python - "$OUT" <<'PY'
import json, re, statistics, sys
out = sys.argv[1]
def row(name):
    recs = {x["op"]: x for x in json.load(open(f"{out}/{name}.json"))}
    c, a = recs["compressed"]["time_us"] / 1e3, recs["allreduce"]["time_us"] / 1e3
    other = re.search(r"([\d.]+) s of it by anything else", open(f"{out}/{name}.log").read()).group(1)
    return c, a, a / c, other
print("# emulated times (measured / d), ms, mean of 5 calls; speedup = allreduce / 1-bit; other = CPU s not the ranks'")
print(f"# {'hosts':>5} {'cpu':>14} | {'round 1: 1-bit':>14} {'allreduce':>9} {'speedup':>7} {'other':>5} | "
      f"{'round 2: 1-bit':>14} {'allreduce':>9} {'speedup':>7} {'other':>5} | {'median 1-bit':>12}")
for hosts, mode, what in ((2, "pin", "pinned"), (2, "d1", "d = 1, no slack"), (2, "d2", "d = 2"),
                          (4, "d2", "d = 2, no slack"), (4, "d3", "d = 3"), (4, "d4", "d = 4")):
    r = [row(f"{hosts}h_10g_{mode}_r{i}") for i in (1, 2)]
    cells = " | ".join(f"{c:14.1f} {a:9.1f} {s:6.2f}x {o:>5}" for c, a, s, o in r)
    print(f"  {hosts:>5} {what:>14} | {cells} | {statistics.median(x[0] for x in r):12.1f}")
PY
