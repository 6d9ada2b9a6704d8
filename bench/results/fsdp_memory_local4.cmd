python bench/fsdp_memory.py --json bench/results/fsdp_memory_local4.json
