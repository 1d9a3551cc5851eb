"""``python -m per_rank_cli [--nodes] MODULE ARGS...``: ``MODULE`` as ``__main__`` with ``{rank}`` in its
arguments replaced by this rank's number and ``{rank:a,b,...}`` by the rank-th word of the list: each
rank its own paths or values, as node-local copies or a per-rank mistake would give them.  ``--nodes``: each rank alone on its node (LOCAL_RANK 0 of LOCAL_WORLD_SIZE 1,
GROUP_RANK its rank), as a job of one rank per node sees its environment.
"""

from __future__ import annotations

import os
import re
import runpy
import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--nodes":
        args = args[1:]
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=os.environ["RANK"])
    rank = os.environ["RANK"]

    def per_rank(arg: str) -> str:
        m = re.fullmatch(r"\{rank:(.*)\}", arg)
        return m.group(1).split(",")[int(rank)] if m else arg.replace("{rank}", rank)
    sys.argv = [args[0], *map(per_rank, args[1:])]
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)
