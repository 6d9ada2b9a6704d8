# Time dilation checked against pinning (SPEC 7): the same 2-host cluster of one core per host,
# pinned (each host on a core of its own, undilated) and emulated (each host half a core, links
# at half the rate, times divided by d = 2), 100 MiB fp32, compressed vs gloo allreduce.
# Run from the repository root as root, with python the project's environment; each run holds
# the machine alone (flock -x). Tables go to netsim_validation.txt, the residuals at its end.
OUT=${OUT:-/tmp/netsim_validation}; ROUNDS=${ROUNDS:-4}; mkdir -p "$OUT"
BW="python bench/allreduce_bw.py --backend gloo --min-bytes 100M --max-bytes 100M --iters 5 --warmup 2 -q"
run() {  # mode rate round netsim-options...
  echo "== round $3, $2, $1"
  flock -x /tmp/compcomm-cpu.lock python bench/netsim.py --hosts 2 --rate "$2" "${@:4}" \
    --subnet 10.77.65.0/24 --tag nsev -- $BW --json "$OUT/$1_$2_$3.json" 2>&1 | grep -v '^\[W' | tee "$OUT/$1_$2_$3.log"
}
for round in $(seq "$ROUNDS"); do
  for rate in 1gbit 10gbit; do
    run pinned $rate $round --cpus-per-host 1 --pin
    run emulated $rate $round --cpus-per-host 1 --dilate 2
  done
done
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out = sys.argv[1]
rounds = int(sys.argv[2])
def others(mode, rate, r):  # CPU seconds taken by anything but the ranks during the run
    line = [x for x in open(f"{out}/{mode}_{rate}_{r}.log") if "CPU over the run" in x][0]
    return float(line.split(" s of it by")[0].rsplit(" ", 1)[1])
def times(mode, rate, r, key):
    recs = {x["op"]: x for x in json.load(open(f"{out}/{mode}_{rate}_{r}.json"))}
    assert recs["compressed"]["dilation"] == (2 if mode == "emulated" else 1)
    c, a = recs["compressed"][key] / 1e3, recs["allreduce"][key] / 1e3
    return c, a, a / c
def row(rate, r, p, e, busy=""):
    return (f"  {rate:>6} {r:>5} | {p[0]:11.1f} {p[1]:9.1f} {p[2]:6.2f}x | {e[0]:10.1f} {e[1]:9.1f} {e[2]:6.2f}x | "
            + " ".join(f"{e[i] / p[i] - 1:+8.1%}" for i in range(3)) + busy)
for key, what in (("time_us", "mean of the 5 timed calls"), ("time_min_us", "fastest of the 5 timed calls")):
    print(f"# {what}; times in ms (emulated: measured / d); speedup = allreduce / compressed; "
          "residual = emulated / pinned - 1")
    print(f"# {'rate':>6} {'round':>5} | {'pinned 1bit':>11} {'allreduce':>9} {'speedup':>7} | "
          f"{'emul. 1bit':>10} {'allreduce':>9} {'speedup':>7} | {'res 1bit':>8} {'res allr':>8} {'res spd':>8} | "
          "other CPU (s) pinned / emulated")
    for rate in ("1gbit", "10gbit"):
        runs = [(times("pinned", rate, r, key), times("emulated", rate, r, key)) for r in range(1, rounds + 1)]
        for r, (p, e) in enumerate(runs, 1):
            print(row(rate, r, p, e, f" | {others('pinned', rate, r):6.1f} / {others('emulated', rate, r):.1f}"))
        median = [[statistics.median(x[k][i] for x in runs) for i in range(3)] for k in (0, 1)]
        print(row(rate, "med.", *median))
PY
