"""`trainfit <command>` with PyTorch's CUDA memory history recorded, dumped to a snapshot on exit.

    python -m bench.gpu_snapshot OUT.pickle train CONFIG.yaml [overrides...]
    python -m bench.gpu_snapshot --memory-fraction 0.35 - train CONFIG.yaml    # a capped card, no snapshot

For reading afterwards: drag OUT.pickle onto https://pytorch.org/memory_viz, or load it with
`pickle` (torch.cuda.memory._snapshot format: `segments` with every live block and the Python stack
that allocated it, `device_traces` with the last MAX_ENTRIES alloc/free events). Python frames only
(C++ symbolization takes minutes on a large trace). bench/gpu_check.py reruns a trainer case this
way when the planner put it more than 5% under what it used. A DeepSpeed config must be started
under a launcher (torch.distributed.run) so trainfit does not relaunch itself into a process this
module does not wrap; only rank 0 dumps. Without CUDA nothing is recorded (the rehearsal): the
command runs and OUT gets a small JSON note instead.

`--memory-fraction F` caps this process's CUDA caching allocator at F of the card
(torch.cuda.set_per_process_memory_fraction) before the command runs: past it, PyTorch raises its real
torch.OutOfMemoryError, so an out-of-memory case can run beside other processes on one card without
taking their memory. OUT `-` records nothing.
"""

from __future__ import annotations

import json
import os
import sys

import torch

MAX_ENTRIES = 100_000


def main(argv: list[str]) -> int:
    fraction = None
    if argv and argv[0] == "--memory-fraction":
        fraction, argv = float(argv[1]), argv[2:]
    out, args = argv[0], argv[1:]
    cuda = torch.cuda.is_available()
    if cuda and fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction)
    record = out != "-"
    if record:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if cuda and record:
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    from trainfit.app.cli import app

    code = 0
    try:
        rv = app(args=args, standalone_mode=False)  # click returns typer.Exit's code here
        code = rv if isinstance(rv, int) else 0
    except SystemExit as e:  # typer.Exit / cli.fail
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001 - a failed run's snapshot is the most useful one
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        if record and os.environ.get("RANK", "0") == "0":
            if cuda:
                torch.cuda.memory._dump_snapshot(out)
                torch.cuda.memory._record_memory_history(enabled=None)
            else:
                with open(out, "w") as f:
                    json.dump({"rehearsal": True, "note": "no CUDA: no memory history to record"}, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
