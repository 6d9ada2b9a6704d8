# One NVIDIA H100 80GB HBM3 lent through the device tool (2026-11-28): Python 3.12.3, torch 2.11.0+cu130, cupy-cuda13x 14.2.0,
# Open MPI's mpirun (not CUDA-aware). compcomm installed there with:
python3 -m pip install --no-build-isolation --no-deps --no-index -e .
# gpu_h100_tests.txt (the GPU tests: the CUDA codec kinds, NCCL on one GPU, CUDA tensors over MPI staged through pinned memory):
python3 -m pytest -q -rs tests/test_codec.py tests/test_nccl.py tests/test_pinned.py
# gpu_h100_codec_speed.{txt,json}:
COMPCOMM_BENCH_DEVICES=cuda COMPCOMM_BENCH_DTYPES=float32,bfloat16 python3 -m pytest -q bench/test_codec_speed.py --benchmark-json gpu_h100_codec_speed.json
# gpu_h100_mpi_staged_2ranks.{txt,json}: 2 ranks on the one GPU, CUDA tensors, MPI not CUDA-aware (staged through pinned host memory):
mpirun --allow-run-as-root --oversubscribe -n 2 python3 bench/allreduce_bw.py --backend mpi -b 1M -e 64M --json gpu_h100_mpi_staged_2ranks.json
# gpu_h100_nccl_1rank.{txt,json}: one rank (world size 1: the codec and the call's fixed costs, no transfer):
python3 bench/allreduce_bw.py --backend nccl --nprocs 1 -b 1M -e 64M --json gpu_h100_nccl_1rank.json
