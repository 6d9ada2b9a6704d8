# Time dilation checked against pinning for hosts of two ranks (SPEC 7): 2 hosts x 2 ranks, a core
# per host, pinned (each host on a core of its own, undilated) and emulated (each host half a core
# and confined to one core, links at half the rate, times divided by d = 2), 25 and 100 MiB fp32,
# flat 1-bit against hierarchical (shared memory inside the host). Run from the repository root as
# root, with python the project's environment; each run holds the machine alone (flock -x).
OUT=${OUT:-/tmp/netsim_validation_2x2}; mkdir -p "$OUT"
BW="python bench/allreduce_bw.py --backend gloo -q --ops compressed --hierarchical -b 25M -e 100M -f 4 -n 7 -w 2"
for round in 1 2 3 4; do
  for mode in pinned emulated; do
    opts="--cpus-per-host 1 --pin"; [ $mode = emulated ] && opts="--cpus-per-host 1 --dilate 2"
    echo "== round $round, $mode"
    flock -x /tmp/compcomm-cpu.lock python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 1gbit $opts \
      --subnet 10.77.213.0/24 --tag nsvm -- $BW --json "$OUT/${mode}_$round.json" 2>&1 | grep -v '^\[W' | tee "$OUT/${mode}_$round.log"
  done
done
python - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
rows = {}
for mode in ("pinned", "emulated"):
    for r in range(1, 5):
        for rec in json.load(open(f"{out}/{mode}_{r}.json")):
            rows.setdefault((mode, rec["size_bytes"], "hier" if rec["backend"] == "hierarchical" else rec["op"]), []).append(rec["time_us"] / 1e3)
print("# mean of the 7 timed calls, ms (emulated: measured / d, d = 2); speedup = flat 1-bit / hierarchical; residual = emulated / pinned - 1")
print("# size    round | pinned flat    hier speedup | emul. flat    hier speedup |  res flat  res hier   res spd")
for size in (26214400, 104857600):
    meds = {}
    for r in range(5):
        vals = {}
        for mode in ("pinned", "emulated"):
            if r < 4:
                f, h = rows[(mode, size, "compressed")][r], rows[(mode, size, "hier")][r]
            else:
                f, h = statistics.median(rows[(mode, size, "compressed")]), statistics.median(rows[(mode, size, "hier")])
            vals[mode] = (f, h, f / h)
        p, e = vals["pinned"], vals["emulated"]
        label = str(r + 1) if r < 4 else "med."
        print(f"  {size >> 20:>3} MiB {label:>5} | {p[0]:11.1f} {p[1]:7.1f} {p[2]:6.2f}x | {e[0]:10.1f} {e[1]:7.1f} {e[2]:6.2f}x | "
              + " ".join(f"{e[i] / p[i] - 1:+9.1%}" for i in range(3)))
PY
