# The delay line (bench/netsim.py --delay, bench/netsim_delay.py) checked with bench/link_probe.py:
# TCP round trip (50 pings) and one bulk TCP transfer (64 MiB, default TCP buffers) between two
# hosts; the bridge without delay for comparison; the delay line's own CPU time in its last line.
# Run from the repository root as root, with python the project's environment.
probe() { flock -x /tmp/compcomm-cpu.lock python bench/netsim.py --hosts 2 --subnet 10.77.66.0/24 --tag nsel "$@" \
            -- python bench/link_probe.py --pings 50 --bulk-mib 64 2>&1 | grep -v '^\[W'; }
for args in "--rate 100mbit" "--rate 100mbit --delay 20ms" "--rate 100mbit --delay 1ms" \
            "--rate 1gbit --delay 20ms" "--rate 1gbit --delay 0.001ms" "--rate 10gbit --delay 0.001ms" \
            "--rate 100mbit --delay 20ms --cpus-per-host 1 --dilate 2"; do
  echo "== bench/netsim.py $args"
  probe $args
done
