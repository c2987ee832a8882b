"""Where one side of a workload spends its time: cProfile plus the meter's generate/train split.

    .venv/bin/python -m bench.profiling grpo-tiny --side trainfit            # the workload's settings
    .venv/bin/python -m bench.profiling grpo-smollm2 --side trl --steps 3
    .venv/bin/python -m bench.profiling grpo-tiny --side trainfit --out /tmp/tf.prof   # for snakeviz etc.

Runs in this process (not a subprocess), one repetition, and prints per step: wall time, time in the
model's generate, and the rest (scoring, log-prob forwards, backward, optimizer), then the functions
with the largest cumulative and own time over the optimizer steps (imports and loading excluded).
Timings under the profiler are inflated for Python-heavy code; use bench.run for the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import resource
import tempfile
from pathlib import Path

import torch

from bench import sides
from bench.sides import run_trainfit, run_trl
from bench.workloads import WORKLOADS, prepare


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=list(WORKLOADS))
    ap.add_argument("--side", choices=("trainfit", "trl"), required=True)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None, help="also write the raw cProfile stats here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="trainfit config override for a what-if run, e.g. train.logits_chunk_rows=256")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "0")) or os.cpu_count() or 1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="trainfit-profile-"))
    spec = WORKLOADS[args.name]
    if args.steps:
        spec = dataclasses.replace(spec, steps=args.steps)
    spec = prepare(spec, work)
    if args.set and args.side != "trainfit":
        ap.error("--set applies to the trainfit side only")
    prof = cProfile.Profile()
    # Profile the optimizer steps only (not imports, model loading or the final save): switch the
    # profiler on at the meter's first step and off after its last.
    begin, end_step = sides.Meter.begin, sides.Meter.end_step

    def profiled_begin(self):
        if self.t_begin is None:
            prof.enable()
        begin(self)

    def profiled_end_step(self):
        end_step(self)
        if len(self.ends) == self.steps:
            prof.disable()

    sides.Meter.begin, sides.Meter.end_step = profiled_begin, profiled_end_step
    if args.side == "trainfit":
        raw = run_trainfit(spec, spec.seed, work / args.side, overrides=tuple(args.set))
    else:
        raw = run_trl(spec, spec.seed, work / args.side)
    m = raw["meter"]
    print(f"{args.name} / {args.side}: step  wall_s  generate_s  rest_s  gen_tokens  train_tokens")
    for i, (s, g, gt, tt) in enumerate(zip(m.step_seconds(), m.gen_s, m.gen_tokens, m.seq_tokens), 1):
        print(f"  {i:4d}  {s:7.3f}  {g:10.3f}  {s - g:6.3f}  {gt:10d}  {tt:12d}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB (profiler overhead included)")
    if args.out:
        prof.dump_stats(args.out)
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(args.top)
        print(f"\n---- top {args.top} by {key} ----")
        print("\n".join(buf.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    main()
