# Time dilation checked against pinning at small sizes (256 KiB, 1 MiB, 4 MiB), where a call is a
# few collectives' latency: the same 2-host cluster of one core per host, pinned (each host on a
# core of its own, undilated) and emulated (d = 2: each host half a core, links at half the rate,
# times divided by 2), 1 and 10 Gbit/s, gloo; 3 rounds, run on 2026-11-30 at 5e37620.
# The emulated runs were made twice, with bench/netsim_cpu.py's CFS_PERIOD_US at its value
# (10000) and at 2000 (edited for the run as below, and restored with git checkout afterwards).
# Run from the repository root as root, with python the project's environment.
OUT=${OUT:-/tmp/netsim_validation_small}; mkdir -p "$OUT"
BW="python bench/allreduce_bw.py --backend gloo --min-bytes 256K --max-bytes 4M -f 4 --iters 30 --warmup 3 -q"
run() {  # period round
  sed -i "s/^CFS_PERIOD_US = .*/CFS_PERIOD_US = $1/" bench/netsim_cpu.py
  for rate in 10gbit 1gbit; do
    python bench/netsim.py --hosts 2 --rate $rate --cpus-per-host 1 --pin --subnet 10.77.91.0/24 --tag nsper \
      -- $BW --json "$OUT/pinned_${rate}_p$1_r$2.json" > "$OUT/pinned_${rate}_p$1_r$2.log" 2>&1
    python bench/netsim.py --hosts 2 --rate $rate --cpus-per-host 1 --dilate 2 --subnet 10.77.91.0/24 --tag nsper \
      -- $BW --json "$OUT/emul_${rate}_p$1_r$2.json" > "$OUT/emul_${rate}_p$1_r$2.log" 2>&1
  done
}
for round in 1 2 3; do run 10000 $round; run 2000 $round; done
git checkout bench/netsim_cpu.py
python - "$OUT" <<'PY'
import collections, glob, json, statistics as st, sys
d = collections.defaultdict(list)
for f in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    mode, rate, p, _ = f.rsplit("/", 1)[1][:-5].split("_")
    key = "pinned" if mode == "pinned" else f"emulated, period {int(p[1:]) // 1000} ms"
    for rec in json.load(open(f)):
        d[(rate, rec["size_bytes"], key, rec["op"])].append(rec["time_us"] / 1e3)
print("| link | size | hosts | 1-bit call (ms) | gloo allreduce (ms) | allreduce / 1-bit |")
print("|---|---|---|---|---|---|")
for rate in ("1gbit", "10gbit"):
    for size in (262144, 1048576, 4194304):
        for key in ("pinned", "emulated, period 10 ms", "emulated, period 2 ms"):
            c, a = d[(rate, size, key, "compressed")], d[(rate, size, key, "allreduce")]
            ratio = st.median(x / y for x, y in zip(a, c))
            print(f"| {rate[:-4]} Gbit/s | {size >> 10} KiB | {key} | {st.median(c):.2f} ({min(c):.2f}-{max(c):.2f}) "
                  f"| {st.median(a):.2f} ({min(a):.2f}-{max(a):.2f}) | {ratio:.2f}x |")
PY
