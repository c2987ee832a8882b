"""`trainfit train --dry-run`: everything `train` checks before its first step, and what it would run.

It validates the config, refuses what the trainer does not run (trainfit/runnable.py), checks the
launch (DeepSpeed installed, enough visible GPUs) and the run dir as `train` would, and plans every
stage: the planner builds each stage's architecture on the meta device (no weights are loaded, no
step runs). Any refusal is a ConfigError, so the exit code is the one `train` would give (2).
"""

from __future__ import annotations

from trainfit.config import Config, ConfigError, expand_stages


def dry_run(cfg: Config, *, resume: bool, overwrite: bool) -> list[str]:
    """Lines saying what `trainfit train` would run; raises ConfigError where it would refuse."""
    from trainfit import dist
    from trainfit.plan import plan
    from trainfit.plan.counts import describe
    from trainfit.plan.memory import verdict
    from trainfit.runnable import require_trainable
    from trainfit.train import rundir

    require_trainable(cfg)
    if cfg.world_size > 1 or cfg.engine() == "deepspeed":
        dist.check_launch(cfg)
    rundir.check_run_dir(cfg, resume=resume, overwrite=overwrite)
    stages = expand_stages(cfg)
    d = cfg.distributed
    lines = [f"would train {len(stages)} stage(s) into {cfg.run_dir} on {cfg.train.device}, "
             f"{cfg.world_size} rank(s): {cfg.engine()}"
             + (f" ZeRO-{d.zero_stage}" if cfg.engine() == "deepspeed" else "")]
    for i, s in enumerate(stages):
        try:
            p = plan(s, suggest=False)
            mem = (f"planned peak {p.peak / 2**30:.1f} GiB per GPU on {p.gpu} ({verdict(p)}, {p.gpu_source}); "
                   f"{describe(p.counts)}")
        except ConfigError as e:  # e.g. a hub model whose config is not cached: train would download it
            mem = f"not planned: {e}"
        rollout = f", rollout engine {s.rollout.engine}" if s.stage in ("grpo", "ppo") else ""
        lines.append(f"stage {i} {s.stage}: {s.model.name if i == 0 else '(previous stage)'} "
                     f"{s.peft.method if s.peft.method != 'none' else 'full'}"
                     f"{' ' + s.model.quantization if s.model.quantization != 'none' else ''}, "
                     f"{s.batch_plan().describe()}, {s.train.max_steps} steps{rollout}; {mem}")
    return lines
