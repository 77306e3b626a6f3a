"""Run a computation on forked gloo processes and bring rank 0's results back (CPU tests of the ring)."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, compute, init_file, results_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = compute(rank, world)
    if rank == 0:
        torch.save(results, results_file)
    dist.barrier()
    dist.destroy_process_group()


def on_gloo_ranks(compute, world: int, folder) -> dict:
    """``compute(rank, world) -> dict`` (a module-level function) on ``world`` processes joined in a gloo
    group; rank 0's dict.

    fork: the workers start at once instead of importing torch again (they touch no GPU). Once this
    process has used CUDA, autograd's device threads make a forked child's backward fail, so the
    workers are spawned instead (they import the test module and run ``compute`` from there).
    """
    start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(_worker, args=(world, compute, str(folder / "init"), str(folder / "results.pt")),
                       nprocs=world, start_method=start_method)
    return torch.load(folder / "results.pt")
