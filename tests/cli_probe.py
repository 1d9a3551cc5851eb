"""A ``python -m`` target for the harness's own tests of ``run_cli`` (see test_harness.py)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank}/{world} sum {t.item():g} threads {torch.get_num_threads()} argv {sys.argv[1:]}")
    print(f"rank {rank} to stderr", file=sys.stderr)
    what = sys.argv[1]
    if what == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "exit" and rank == 1:
        sys.exit(3)
    if what in ("kill", "exit"):
        time.sleep(600)  # a rank left waiting on a dead peer: the launcher must stop it
    dist.destroy_process_group()
