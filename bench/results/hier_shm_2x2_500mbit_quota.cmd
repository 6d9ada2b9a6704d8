# 2 hosts x 2 ranks, links at 500 Mbit/s (1 Gbit/s / d, d = 2), CPU quotas (cgroup v1 cfs) attached from outside by QUOTA.py, given below:
# per-rank: one cgroup of 0.5 core per rank (a core per rank, dilated by 2); per-host: 1 core per host shared by its 2 ranks (as netsim --cpus-per-host 2)
python QUOTA.py per-rank 0.5 shmq -- python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 500mbit --subnet 10.77.73.0/24 --tag shm3 -- python bench/allreduce_bw.py --hierarchical --intra shm --ops compressed --min-bytes 25M --max-bytes 100M --factor 4 --iters 5 --warmup 2 -q --json bench/results/hier_shm_2x2_500mbit_quota_per-rank_shm.json
python QUOTA.py per-rank 0.5 shmq -- python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 500mbit --subnet 10.77.73.0/24 --tag shm3 -- python bench/allreduce_bw.py --hierarchical --intra gloo --ops compressed --min-bytes 25M --max-bytes 100M --factor 4 --iters 5 --warmup 2 -q --json bench/results/hier_shm_2x2_500mbit_quota_per-rank_gloo.json
python QUOTA.py per-host 1.0 shmq -- python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 500mbit --subnet 10.77.73.0/24 --tag shm3 -- python bench/allreduce_bw.py --hierarchical --intra shm --ops compressed --min-bytes 25M --max-bytes 100M --factor 4 --iters 5 --warmup 2 -q --json bench/results/hier_shm_2x2_500mbit_quota_per-host_shm.json
python QUOTA.py per-host 1.0 shmq -- python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 500mbit --subnet 10.77.73.0/24 --tag shm3 -- python bench/allreduce_bw.py --hierarchical --intra gloo --ops compressed --min-bytes 25M --max-bytes 100M --factor 4 --iters 5 --warmup 2 -q --json bench/results/hier_shm_2x2_500mbit_quota_per-host_gloo.json
# ---- QUOTA.py ----
# """Run a netsim command with CPU quotas per host or per rank (cgroup v1), attached from outside.
# 
#     python quota.py per-rank|per-host CORES_PER_RANK_OR_HOST TAG -- python bench/netsim.py ... -- python bench/allreduce_bw.py ...
# 
# The ranks (processes whose command line holds 'allreduce_bw.py' and that descend from the
# command) are moved, as soon as they appear, into cgroups with cfs quota = cores x period:
# per-rank: one cgroup each; per-host: one per host (RANK // LOCAL_WORLD_SIZE).
# """
# 
# import os
# import subprocess
# import sys
# import time
# from pathlib import Path
# 
# BASE = Path("/sys/fs/cgroup/cpu")
# PERIOD = 10000
# 
# 
# def descendants(root: int) -> list[int]:
#     children: dict[int, list[int]] = {}
#     for entry in os.listdir("/proc"):
#         if entry.isdigit():
#             try:
#                 ppid = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
#             except (OSError, IndexError, ValueError):
#                 continue
#             children.setdefault(ppid, []).append(int(entry))
#     out, todo = [], [root]
#     while todo:
#         pid = todo.pop()
#         for c in children.get(pid, []):
#             out.append(c)
#             todo.append(c)
#     return out
# 
# 
# def env_of(pid: int) -> dict[str, str]:
#     raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
#     return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
# 
# 
# def main() -> int:
#     mode, cores, tag = sys.argv[1], float(sys.argv[2]), sys.argv[3]
#     cmd = sys.argv[sys.argv.index("--") + 1 :]
#     proc = subprocess.Popen(cmd)
#     made: dict[str, Path] = {}
#     placed: set[int] = set()
#     try:
#         while proc.poll() is None:
#             for pid in descendants(proc.pid):
#                 if pid in placed:
#                     continue
#                 try:
#                     if "allreduce_bw.py" not in Path(f"/proc/{pid}/cmdline").read_text():
#                         continue
#                     env = env_of(pid)
#                 except OSError:
#                     continue
#                 if "RANK" not in env:
#                     continue
#                 rank, k = int(env["RANK"]), int(env.get("LOCAL_WORLD_SIZE", "1"))
#                 name = f"{tag}r{rank}" if mode == "per-rank" else f"{tag}h{rank // k}"
#                 if name not in made:
#                     path = BASE / name
#                     path.mkdir(exist_ok=True)
#                     (path / "cpu.cfs_period_us").write_text(str(PERIOD))
#                     (path / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD)))
#                     made[name] = path
#                 (made[name] / "cgroup.procs").write_text(str(pid))
#                 placed.add(pid)
#                 print(f"[quota] rank {rank} (pid {pid}) -> {name}: {cores} core(s)", file=sys.stderr, flush=True)
#             time.sleep(0.05)
#     finally:
#         proc.wait()
#         for path in made.values():
#             for _ in range(100):
#                 try:
#                     path.rmdir()
#                     break
#                 except OSError:
#                     time.sleep(0.05)
#     return proc.returncode
# 
# 
# if __name__ == "__main__":
#     sys.exit(main())
