#!/usr/bin/env bash
# Record the 4-host simulated-Ethernet sweeps (1 MB .. 256 MB) into bench/results/.
#
#   sudo bench/run_netsim_sweeps.sh                 # both rates, default tag "before"
#   TAG=after RATES="1gbit" sudo -E bench/run_netsim_sweeps.sh
#
# For each rate it writes netsim_4h_<rate>_<tag>.{json,png,txt,cmd}: the SPEC 7 records, the
# busbw plot, the printed table and the exact command. Needs root, iproute2 and sch_tbf.
# Run nothing else heavy meanwhile: ranks share this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
TAG=${TAG:-before}
RATES=${RATES:-"1gbit 10gbit"}
HOSTS=${HOSTS:-4}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-2}
OUT=bench/results
mkdir -p "$OUT"
for rate in $RATES; do
    base="$OUT/netsim_${HOSTS}h_${rate}_${TAG}"
    cmd=("$PYTHON" bench/netsim.py --hosts "$HOSTS" --rate "$rate" --
         "$PYTHON" bench/allreduce_bw.py --backend gloo --min-bytes 1M --max-bytes 256M
         --iters "$ITERS" --warmup "$WARMUP" --json "$base.json" --plot "$base.png"
         --title "netsim $HOSTS hosts, $rate links")
    printf '%q ' "${cmd[@]}" | sed 's/ $//' > "$base.cmd"
    echo >> "$base.cmd"
    echo "== $(cat "$base.cmd")" >&2
    "${cmd[@]}" | tee "$base.txt"
done
