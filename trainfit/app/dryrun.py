"""`trainfit train --dry-run`: what `trainfit train` would run, after the same check it makes.

The check is trainfit/train/preflight.py's, shared with `train` and `plan` (exit 0 ready, 1 a stage does
not fit a card named or detected, 2 an error); this module only says what passed: the stages, their
batch arithmetic and each stage's plan (built on the meta device: no weights load, no step runs).
"""

from __future__ import annotations

from trainfit.config.stages import stage_spec
from trainfit.config import Config
from trainfit.config.words import count
from trainfit.plan.counts import describe as describe_counts
from trainfit.plan.memory import verdict
from trainfit.train.preflight import Ready


def describe(cfg: Config, ready: Ready) -> list[str]:
    """Lines saying what `trainfit train` would run."""
    stages, d = ready.stages, cfg.distributed
    lines = [f"would train {count(len(stages), 'stage')} into {cfg.run_dir} on {cfg.train.device}, "
             f"{count(cfg.world_size, 'rank')}: {cfg.engine()}"
             + (f" ZeRO-{d.zero_stage}" if cfg.engine() == "deepspeed" else "")]
    for i, (s, p) in enumerate(zip(stages, ready.plans or [None] * len(stages))):
        if p is None:
            mem = "not planned"
        else:
            gates = "" if p.gpu_source != "assumed" else ", an assumed card: not a limit"
            mem = (f"planned peak {p.peak / 2**30:.1f} GiB per GPU on {p.gpu} ({verdict(p)}, {p.gpu_source}{gates}); "
                   f"{describe_counts(p.counts)}")
        rollout = f", rollout engine {s.rollout.engine}" if stage_spec(s.stage).rollout else ""
        lines.append(f"stage {i} {s.stage}: {s.model.name if i == 0 else '(previous stage)'} "
                     f"{s.peft.method if s.peft.method != 'none' else 'full'}"
                     f"{' ' + s.model.quantization if s.model.quantization != 'none' else ''}, "
                     f"{s.batch_plan().describe()}, {s.train.max_steps} steps{rollout}; {mem}")
    lines += [f"note: {n}" for n in ready.notes]
    return lines
