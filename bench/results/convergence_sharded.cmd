python bench/convergence.py --runs fsdp_adam,fsdp_onebit_adam,fsdp_sgd,fsdp_onebit_sgd,hsdp_adam,hsdp_onebit_adam,hsdp_sgd,hsdp_onebit_sgd --tag sharded --out bench/results
