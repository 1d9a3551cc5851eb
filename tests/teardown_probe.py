"""``torchrun -m teardown_probe CHECKPOINT EP``: an API user's script that loads a model sharded and returns,
leaving the interpreter's exit to sq's ``teardown_at_exit``."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    import torch.distributed as dist

    import sq
    from sq.dist import init_distributed

    init_distributed()
    model = sq.load_sharded(sys.argv[1], ep=int(sys.argv[2]))
    print(f"rank {dist.get_rank()}: loaded {sum(p.numel() for p in model.parameters())} parameters", flush=True)
