"""The check that every row of a plan is true (issue 46), shared by the tests that plan examples: the rows
add up to the plan's totals (each phase's column, and the CPU RAM column to the node's CPU RAM), no row
holds negative bytes or repeats another's name, each model that trains with Adam has its optimizer-state
row wherever its moments live (GPU or, offloaded, CPU RAM), and gathered layers are named for what
shards them (FSDP or ZeRO-3)."""

from trainfit.config.stages import stage_spec


def check_rows(p, cfg) -> None:
    """`p`: the plan of the single-stage config `cfg`."""
    for ph in [ph for ph in ("rollout", "train") if ph in p.phases]:
        rows = [(i.name, getattr(i, ph)) for i in p.items]
        assert sum(b for _, b in rows) == p.phases[ph].total, (ph, rows)
    procs_per_node = cfg.world_size // cfg.distributed.num_nodes
    assert sum(i.cpu for i in p.items) * procs_per_node == p.cpu_ram
    negative = [(i.name, i.rollout, i.train, i.cpu) for i in p.items if min(i.rollout, i.train, i.cpu) < 0]
    assert not negative, negative
    names = [i.name for i in p.items]
    assert len(names) == len(set(names)), names
    for group in ["policy"] + (["value"] if stage_spec(p.stage).critic else []):
        opt = [i for i in p.items if i.name == f"{group} optimizer state"]
        # every example trains with an AdamW (torch, 8-bit or paged): its moments are on some row
        assert opt and opt[0].train + opt[0].cpu > 0, (group, names)
    other = "ZeRO-3" if cfg.engine() == "fsdp" else "FSDP"
    assert not any(n.startswith(other) for n in names), names
