"""`python tests/forked_ranks.py --nproc_per_node=N train.py ARGS...`: N ranks of train.py, forked.

torchrun starts every rank as a new interpreter; on the CI's 2 CPU cores its launcher and each rank
spend 3-4 s importing torch, several times what a tiny test run trains. The tests that check what
several ranks compute (not how torchrun starts them) start them here instead: this process imports
train.py's modules once, then forks the ranks, each with the environment torchrun gives a rank
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1), and runs
train.py as `python train.py ARGS` would. Tests of torchrun itself (its signals, its errors) start
torchrun. CPU only: a forked child cannot use CUDA that its parent started (this process starts none).

Exits with the status of the first rank that fails, after stopping the others (as torchrun does), else 0.
"""
import os
import runpy
import signal
import socket
import sys

import torch
import torch._dynamo  # noqa: F401  (building an optimizer imports it: 1.4 s a rank otherwise)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, script: str, args: list) -> int:
    """In a forked child: train.py as rank ``rank`` of ``world``; its exit status."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main(argv: list) -> int:
    flag, script, *args = argv
    world = int(flag.removeprefix("--nproc_per_node="))
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__imports__")  # its imports, once, for every rank
    port = free_port()
    children = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os._exit(run_rank(rank, world, port, script, args))
        children.append(pid)
    status = 0
    while children:
        pid, wait_status = os.wait()
        children.remove(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code and not status:
            status = code
            for other in children:
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
