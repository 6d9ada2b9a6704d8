mpirun --allow-run-as-root --oversubscribe -n 4 python bench/allreduce_bw.py --backend mpi --json bench/results/local4_mpi.json
