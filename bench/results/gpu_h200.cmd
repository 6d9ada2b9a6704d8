# One NVIDIA H200 (143771 MiB, driver 580.159.04) lent through the device tool for 15 minutes on 2026-11-30: Python 3.12.3,
# torch 2.11.0+cu130, cupy-cuda13x 14.2.0, mpi4py 4.1.2 over Open MPI 4.1.6 (not CUDA-aware). Commit 5c3e17e (runs 2 and 3:
# with this session's changes, uncommitted then). compcomm installed there with:
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e .
# Run 1, 5c3e17e. gpu_h200_tests.txt (the GPU tests), gpu_h200_nccl_1rank.{txt,json}, gpu_h200_codec_speed.{txt,json}:
python3 -m pytest -q -rs -p no:cacheprovider tests/test_codec.py tests/test_nccl.py tests/test_pinned.py
python3 bench/allreduce_bw.py --backend nccl --nprocs 1 -b 1K -e 64M --json gpu_h200_nccl_1rank.json
COMPCOMM_BENCH_DEVICES=cuda COMPCOMM_BENCH_DTYPES=float32,bfloat16 python3 -m pytest -q -p no:cacheprovider bench/test_codec_speed.py --benchmark-json gpu_h200_codec_speed.json
# Run 2 (the first tests/programs/cuda_training_checks.py), gpu_h200_suite_torch211.txt (the whole suite on that machine):
python3 -m pytest -q -rs -p no:cacheprovider tests/test_nccl.py
python3 -m pytest -q -n 6 --dist loadfile -m "not slow and not netns"
# Run 3 (the fsdp import and the MPI fp16 probe fixed), gpu_h200_run3_tests.txt, gpu_h200_training_checks.json
# (each rank's results of tests/programs/cuda_training_checks.py from the test_nccl.py run):
python3 -m pytest -q -rs -p no:cacheprovider tests/test_nccl.py
python3 -m pytest -q -p no:cacheprovider tests/test_mpi.py
