# gpu_h100_call_profile_1rank_{256K,16M}.txt: cProfile of 40 compressed calls on one H100, world size 1 over NCCL (torch 2.11, cupy 14.2),
# commit 3b1e105; the script, run as 'python3 gpu_profile.py' in the repository root:
    """Where a compressed call's fixed cost goes on one GPU (world size 1, NCCL): cProfile of 40 calls."""
    import cProfile, io, os, pstats, sys, time
    import torch, torch.distributed as dist
    sys.path.insert(0, ".")
    import compcomm
    
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    out = os.environ.get("OUT", ".")
    for numel in (1 << 18, 1 << 24):
        x = torch.randn(numel, device="cuda")
        ef = compcomm.ErrorFeedback()
        for _ in range(5):
            compcomm.compressed_allreduce(x, ef)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(40):
            compcomm.compressed_allreduce(x, ef)
        torch.cuda.synchronize()
        print(f"numel {numel}: {(time.perf_counter() - t0) / 40 * 1e3:.3f} ms per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(40):
            compcomm.compressed_allreduce(x, ef)
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        with open(f"{out}/profile_{numel}.txt", "w") as f:
            f.write(s.getvalue())
        print("\n".join(s.getvalue().splitlines()[:45]), flush=True)
    dist.destroy_process_group()
