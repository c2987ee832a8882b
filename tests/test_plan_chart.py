"""The plan pictures' data and layout (plan/chart.py, plan/chart_layout.py), without a browser: the CPU RAM bar
holds the plan's offload, the header names the parameters, the parallelism and the packages, each component has
its own shade, no two placed labels overlap (in the layout, and in the PNG as matplotlib draws it), and a CPU
config is drawn against its own device at a readable scale. Plans are made offline from the catalog."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from trainfit.config import load_config
from trainfit.core.extras import training_machine_line
from trainfit.plan import chart, plan
from trainfit.plan.chart_layout import Box, layout

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GiB = 2 ** 30
_PLANS: dict = {}


def _plan(example: str, gpu=None):
    """The plan of an example as `trainfit plan` makes it (the packages line from the same function)."""
    if (example, gpu) not in _PLANS:
        cfg = load_config(EXAMPLES / example)
        p = plan(cfg, gpu, from_data=False)   # at the length caps: the data's lengths change no label's place
        p.training_machine = training_machine_line([cfg])
        _PLANS[example, gpu] = p
    return _PLANS[example, gpu]


@pytest.fixture(autouse=True)
def _ram(monkeypatch):
    """This machine's RAM, fixed so the CPU config's scale does not depend on the machine running the test."""
    monkeypatch.setattr(chart, "cpu_ram", lambda: {"total": 16 * GiB, "available": 12 * GiB})


def _boxes(lay) -> list[tuple[str, Box]]:
    out = [(t.text, t.box) for t in lay.labels()]
    out += [(t.text, t.box) for title, rows in lay.legend for t in [title] + [r[2] for r in rows]]
    x, y, _ = lay.peak
    return out + [("peak marker", Box(x - 6, y - 6, x + 6, y + 6))]


def _overlaps(boxes) -> list[tuple[str, str]]:
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if ba.overlaps(bb)]


def test_offload_is_drawn_as_a_cpu_ram_bar_and_the_header_says_what_the_text_does():
    p = _plan("sft_7b_zero2_offload.yaml", "a800-80gb")
    c = chart.bars(p)
    assert c.cpu is not None and c.cpu.total_gib == pytest.approx(p.cpu_ram / GiB)
    (opt,) = [s for s in c.cpu.segments if s.name == "policy optimizer state"]
    assert opt.gib == pytest.approx(56.74, abs=0.01)             # Adam's two fp32 moments of 7.62B parameters
    # The offloaded kinds (moments, fp32 masters, the CPU step's temporaries) add up to the text plan's
    # CPU RAM column, 113.48 GiB.
    assert sum(s.gib for s in c.cpu.segments) == pytest.approx(113.48, abs=0.01)
    lay = layout(c)
    assert [a.name for a in lay.axes] == ["gpu", "cpu"]
    totals = [t.text for t in lay.labels() if t.role == "total"]
    assert any(t.startswith("113.48 GiB") for t in totals)
    header = "\n".join(t.text.replace("\n", " ") for t in lay.labels() if t.role == "header")
    assert "7.62B" in header and "deepspeed" in header
    assert "ZeRO-2" in header and "data parallel 1" in header and "offload: optimizer" in header
    assert "1 GPU on 1 node" in header


def test_ppo_components_have_their_own_shades_and_the_scoring_bar_names_its_models():
    c = chart.bars(_plan("ppo_7b_full.yaml"))
    colour = {}
    for b in c.bars + [c.cpu]:
        for s in b.segments:
            assert colour.setdefault(s.name, s.colour) == s.colour    # one colour a component, on every bar
    assert len(set(colour.values())) == len(colour)                 # and no two components share one
    scoring = {s.group for s in next(b for b in c.bars if b.phase == "scoring").segments}
    assert {"policy", "reference", "reward", "value"} <= scoring     # not one "resident states" block
    titles = [g.title for g in c.legend]
    assert any(t.startswith("critic: Qwen/Qwen2.5-7B-Instruct") for t in titles)
    assert any(t.startswith("reward model: Qwen/Qwen2.5-7B-Instruct") for t in titles)
    assert "8 GPUs on 1 node; DeepSpeed ZeRO-3, data parallel 8" in c.header[1]


@pytest.mark.parametrize("example,gpu", [("ppo_7b_full.yaml", None), ("sft_7b_zero2_offload.yaml", "a800-80gb"),
                                         ("agent_tools.yaml", None)])
def test_no_two_labels_of_the_layout_overlap_nor_leave_the_figure(example, gpu):
    lay = layout(chart.bars(_plan(example, gpu)))
    assert _overlaps(_boxes(lay)) == []
    inside = Box(0, 0, lay.width, lay.height)   # nor is one cut by the figure's edge
    assert [t for t, b in _boxes(lay) if (b.x0, b.y0, b.x1, b.y1) != (
        max(b.x0, inside.x0), max(b.y0, inside.y0), min(b.x1, inside.x1), min(b.y1, inside.y1))] == []
    for a in lay.axes:   # and no label but a block's own sits on a bar
        bars = [a.bar_box(b) for b in a.blocks]
        assert [t.text for t in lay.labels() if t.role != "block" and any(t.box.overlaps(b) for b in bars)] == []


def test_the_png_draws_the_layout_without_overlapping_labels(tmp_path):
    """The real extents matplotlib gives each drawn text (and the peak marker) do not overlap."""
    from trainfit.plan.chart_png import figure

    fig, _ = figure([_plan("ppo_7b_full.yaml")])
    fig.set_dpi(72)   # a pixel a point: the extents scale with the resolution, their overlaps do not
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    boxes = []
    for ax in fig.axes:
        for t in ax.texts:
            e = t.get_window_extent(r)
            boxes.append((t.get_text(), Box(e.x0, e.y0, e.x1, e.y1)))
        for ln in ax.lines:
            if ln.get_marker() == ">":
                e = ln.get_window_extent(r)
                boxes.append(("peak marker", Box(e.x0, e.y0, e.x1, e.y1)))
    assert len(boxes) > 30 and _overlaps(boxes) == []
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_cpu_config_is_drawn_against_its_own_device_at_a_readable_scale():
    p = _plan("agent_tools.yaml")                # train.device=cpu
    c = chart.bars(p)
    assert c.device == "cpu" and c.capacity_gib == 16 and c.budget_gib is None and c.cpu is None
    lay = layout(c)
    (gpu,) = lay.axes
    assert "CPU RAM" in gpu.title
    assert max(b.total_gib for b in c.bars) >= 0.4 * gpu.ymax     # the bars fill the axis, not 1% of it
    assert gpu.lines == []                                          # 16 GiB of RAM is named above the scale
    assert any(t.role == "offscale" and "16.00 GiB" in t.text.replace("\n", " ") for t in lay.labels())
    assert any("the CPU" in h for h in c.header) and "on the CPU" in c.title


def test_an_empty_cpu_ram_bar_says_so_on_a_readable_scale():
    c = chart.bars(_plan("ppo_7b_full.yaml"))
    assert c.cpu.total_gib == 0 and c.cpu.segments == []
    lay = layout(c)
    cpu = lay.axes[1]
    assert cpu.ymax == pytest.approx(1.08)
    assert any("nothing planned in CPU RAM" in t.text.replace("\n", " ") for t in lay.labels() if t.role == "total")


def test_parallelism_names_nodes_sharding_and_vllm_tensor_parallel():
    from trainfit.plan.topology import describe_parallelism

    t = {"device": "cuda", "nodes": 2, "gpus_per_node": 8, "processes_per_node": 8, "data_parallel": 16,
         "rollout_gpus": 0, "engine": "fsdp", "zero_stage": 3, "offload": ["optimizer"], "rollout_engine": "vllm",
         "rollout_tensor_parallel": 2}
    assert describe_parallelism(t) == ("2 nodes x 8 GPUs; FSDP2 full shard (as ZeRO-3), data parallel 16, tensor "
                                       "parallel 1 (training), vLLM tensor parallel 2; offload: optimizer")
    cpu = dict(t, processes_per_node=1, data_parallel=1, engine="single", zero_stage=0, offload=[], rollout_engine="hf")
    assert describe_parallelism(cpu, on_cpu=True) == "CPU; one process, data parallel 1, tensor parallel 1 (training)"
