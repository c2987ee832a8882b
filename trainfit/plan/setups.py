"""`trainfit hardware`: every catalog card x GPU count a config could run on, planned and timed, ranked; where a
card's full node (8 GPUs) does not fit, 2, 4 and 8 such nodes too (stopping at the first that fits)."""

from __future__ import annotations

from trainfit.config import ConfigError, validate
from trainfit.core import progress
from trainfit.plan.hardware import RANKED, SETUP_COUNTS
from trainfit.plan.memory import plan, with_gpus
from trainfit.plan.split import compare_splits
from trainfit.plan.steptime import estimate
from trainfit.plan.suggest import suggestions

NODE_COUNTS = (2, 4, 8)   # nodes of a card's largest GPU count, tried where one such node does not fit


def rank_setups(cfg, gpus=None, counts=SETUP_COUNTS, nodes=()) -> list[dict]:
    """Every ranked catalog card x GPU count: planned peak, fit, and estimated step time (steptime.estimate,
    with its basis); fitting setups first, fastest first, then the rest fastest first too (the setups
    that could not be planned last). With `nodes` (`trainfit hardware` passes NODE_COUNTS), a one-node config
    that fits no GPU count of a card is planned on that many nodes of its largest count too, up to the first
    that fits (by itself or with the planner's fix): more nodes shard more, so a count past one that fits
    is only needed for speed, and a config that fits one node costs no extra plans."""
    rows = []
    cards = list(gpus or RANKED)
    for k, g in enumerate(cards):
        own = []
        for n in counts:
            progress.step(f"hardware: planning {n} x {g.name} (card {k + 1} of {len(cards)})")
            own.append((more := _setup_rows(cfg, g, n))[0])
            rows += more
        # More nodes only where no count of one node fits and the largest was planned (a batch that does
        # not divide 8 GPUs divides no number of 8-GPU nodes either).
        if cfg.distributed.num_nodes > 1 or any(r["fits"] for r in own) or own[-1]["fits"] is None:
            continue
        for m in nodes:
            progress.step(f"hardware: planning {m} nodes x {counts[-1]} x {g.name} (card {k + 1} of {len(cards)})")
            rows += (more := _setup_rows(cfg, g, counts[-1], m))
            if more[0]["fits"] is not False or (more[0]["fix"] or {}).get("fits"):
                break
    rows.sort(key=lambda r: (r["fits"] is not True, r["step_s"] is None, r["step_s"] or 0.0,
                             r["num_gpus"] * r["num_nodes"]))
    return rows


def _setup_rows(cfg, g, n: int, nodes: int = 0) -> list[dict]:
    """The row of `cfg` on n GPUs a node of card `g` (on `nodes` nodes when given, else the config's), with the
    planner's fix when it does not fit, then on one node the rows of its async splits."""
    nodes = nodes or cfg.distributed.num_nodes
    where = f"{nodes} nodes x {n}" if nodes > 1 else f"{n}"
    row = {"setup": f"{where} x {g.name}", "gpu": g.key, "num_gpus": n, "num_nodes": nodes, "peak_gb": None,
           "budget_gb": None, "fits": None, "step_s": None, "step_basis": None, "note": "", "fix": None}
    try:
        if nodes != cfg.distributed.num_nodes:
            raw = cfg.model_dump()
            raw["distributed"].update(num_gpus=n, num_nodes=nodes)
            cfg = validate(raw)
        p = plan(cfg, gpu=g.key, num_gpus=n)
    except ConfigError as e:
        row["note"] = str(e)  # whole: a cut sentence hides the fix
        return [row]
    st = estimate(p.work, g, p.world)
    row.update(peak_gb=p.peak / 2**30, budget_gb=p.budget / 2**30, fits=p.fits, step_s=st.total, step_basis=st.basis,
               note=" ".join(p.problems) or f"rollout {st.rollout:.1f}s, train {st.train:.1f}s, comm {st.comm:.1f}s")
    if not p.fits:
        row["fix"] = _fix(cfg, p, g, n)
        row["note"] = " ".join(x for x in (" ".join(p.problems), _fix_note(row["fix"])) if x)
    return [row] + (_split_rows(cfg, g, n) if nodes == 1 else [])


def _split_rows(cfg, g, n: int) -> list[dict]:
    """An RL stage on n >= 2 GPUs: a row per async split of them that `train` runs (plan/split.py), beside
    the row of the config as given."""
    if cfg.rollout.mode == "async" and cfg.distributed.rollout_gpus:
        return []   # the config is a split already: its own row
    rows = []
    for o in compare_splits(cfg, g, num_gpus=n, runnable_only=True):
        st, ovs = o.step, " ".join(f"{k}={v}" for k, v in o.overrides.items())
        rows.append({"setup": f"{n} x {g.name}, async: {o.rollout_gpus} rollout + {o.train_gpus} training",
                     "gpu": g.key, "num_gpus": n, "num_nodes": 1, "peak_gb": o.peak / 2**30, "budget_gb": o.budget / 2**30,
                     "fits": o.fits, "step_s": st.total, "step_basis": st.basis,
                     "note": f"rollout {st.rollout:.1f}s alongside train {st.train:.1f}s + comm {st.comm:.1f}s; {ovs}"})
    return rows


def _fix(cfg, p, g, n: int) -> dict:
    """The planner's first suggestion for a setup that does not fit (suggest.py: planned before it is
    offered): {overrides, fits, peak_gb, change, why}, or an empty one when no change could be planned."""
    sug = suggestions(with_gpus(cfg, n), p, g, limit=1)
    if not sug:
        return {"overrides": [], "fits": False, "peak_gb": None, "change": "",
                "why": "no change searched lowers the peak"}
    s = sug[0]
    return {"overrides": s.overrides, "fits": s.fits, "peak_gb": s.peak / 2**30, "change": s.change, "why": s.why}


def _fix_note(fix: dict) -> str:
    if fix["fits"]:
        return f"Fits with {' '.join(fix['overrides'])} (planned: peak {fix['peak_gb']:.1f} GiB)."
    at_best = f" at best ({' '.join(fix['overrides'])})" if fix["overrides"] else ""
    return f"Nothing searched fits: {fix['why']}{at_best}."
