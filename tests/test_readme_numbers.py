"""bench/readme_numbers.py rewrites the README's measured tables from run records (issue 21 item 10);
here from made-up summaries, without training anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import readme_numbers as rn

ROOT = Path(__file__).resolve().parents[1]
ENV = {"date": "2026-01-02", "cpu": "Some CPU (AVX2)", "cores": 2, "threads": "1", "torch": "2.13.0+cpu",
       "transformers": "5.24.0", "python": "3.11.7", "load_before": 0.5}


def record(config: str, seed: int, accuracy: dict, stages: list[tuple[str, float, float]], wall: float) -> dict:
    """What run_one writes: the run's summary.json (accuracies as fractions) plus wall time and machine."""
    return {"config": config, "seed": seed, "wall_s": wall, "env": {**ENV, "load_before": 0.5 + seed},
            "summary": {"accuracy": accuracy,
                        "stages": [{"stage": s, "seconds": sec, "accuracy_after": acc,
                                    "memory": {"process_peak_rss_gib": 0.5 + i / 100}}
                                   for i, (s, sec, acc) in enumerate(stages)]}}


def test_demo_and_pipeline_sections_are_rewritten_from_the_records():
    demo = [record("demo", 1, {"before sft": 0.0, "after sft": 0.734, "after grpo": 0.834},
                   [("sft", 80.4, 0.734), ("grpo", 250.6, 0.834)], 340.2),
            record("demo", 0, {"before sft": 0.0, "after sft": 0.266, "after grpo": 0.422},
                   [("sft", 81.0, 0.266), ("grpo", 260.0, 0.422)], 351.0)]
    ppo = [record("ppo_pipeline_tiny", 0, {"before sft": 0.0, "after sft": 0.266, "after ppo": 0.3},
                  [("sft", 80, 0.266), ("rm", 90, 0.55), ("ppo", 300, 0.3)], 480)]
    readme = ("# title\nintro\n<!-- readme-numbers:demo -->\nold demo table\n<!-- /readme-numbers:demo -->\n"
              "middle\n<!-- readme-numbers:ppo_pipeline_tiny -->\nold\n<!-- /readme-numbers:ppo_pipeline_tiny -->\nend\n")
    text = rn.replace_section(readme, "demo", rn.render("demo", demo))
    text = rn.replace_section(text, "ppo_pipeline_tiny", rn.render("ppo_pipeline_tiny", ppo))
    lines = text.splitlines()
    assert lines[:3] == ["# title", "intro", "<!-- readme-numbers:demo -->"] and lines[-1] == "end"
    assert "old" not in text and "middle" in text
    rows = [ln for ln in lines if ln.startswith("| 0 ") or ln.startswith("| 1 ")]
    # Sorted by seed; accuracies in percent, the gain in points over the stage before, wall times in s,
    # the largest stage's peak memory.
    assert rows[0] == "| 0 1234 0 (the default) | 0.0% | 26.6% | 42.2% | +15.6 | 351 s (sft 81, grpo 260), 0.51 GiB |"
    assert rows[1] == "| 1 99 5 | 0.0% | 73.4% | 83.4% | +10.0 | 340 s (sft 80, grpo 251), 0.51 GiB |"
    assert rows[2] == "| 0 1234 0 (the default) | 0.0% | 26.6% | 55.0% | 30.0% | +3.4 | 480 s (sft 80, rm 90, ppo 300), 0.52 GiB |"
    assert "torch 2.13.0+cpu, transformers 5.24.0" in text and "Some CPU (AVX2), 2 cores available" in text
    assert "load average 0.5-1.5" in text


def test_a_readme_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="readme-numbers:demo"):
        rn.replace_section("no markers here", "demo", "body")


def test_the_readme_has_one_section_per_config():
    text = (ROOT / "README.md").read_text()
    for config in rn.CONFIGS:
        assert text.count(f"<!-- readme-numbers:{config} -->") == 1
        assert text.count(f"<!-- /readme-numbers:{config} -->") == 1


def test_runs_under_each_cpu_kernel_are_told_apart_and_their_spread_is_stated():
    def run(seed: int, kernel: str, sft: float, grpo: float, used: str) -> dict:
        rec = record("demo", seed, {"before sft": 0.0, "after sft": sft, "after grpo": grpo},
                     [("sft", 80.0, sft), ("grpo", 200.0, grpo)], 290.0)
        rec["env"] = {**rec["env"], "kernel": kernel, "kernel_used": used}
        return rec

    recs = [run(0, "avx512", 0.50, 0.62, "AVX512"), run(0, "default", 0.47, 0.60, "DEFAULT"),
            run(1, "avx2", 0.52, 0.65, "AVX2"), run(0, "avx2", 0.48, 0.61, "AVX2"),
            run(1, "avx512", 0.51, 0.66, "AVX2")]  # a CPU without AVX-512 ran its best below it
    body = rn.render("demo", recs)
    rows = [ln.split(" | ")[0] for ln in body.splitlines() if ln.startswith("| 0 ") or ln.startswith("| 1 ")]
    # Sorted by seed, then by kernel from the lowest instruction set up; the kernel torch fell back to is said.
    assert rows == ["| 0 1234 0 (the default), default", "| 0 1234 0 (the default), avx2",
                    "| 0 1234 0 (the default), avx512", "| 1 99 5, avx2", "| 1 99 5, avx512 (ran AVX2)"]
    # after SFT spans 47-52% (5.0 points), mean 49.6; squared deviations 0.16+6.76+5.76+2.56+1.96 = 17.2,
    # sample variance 17.2/4 = 4.3, sd 2.07, standard error 2.07/sqrt(5) = 0.93.
    # after GRPO spans 60-66% (6.0 points), mean 62.8; 0.64+7.84+4.84+3.24+10.24 = 26.8, /4 = 6.7,
    # sd 2.59, standard error 1.16.
    assert ("Across these 5 runs: after sft 47.0-52.0% (5.0 points apart; mean 49.6% +- 0.9, the standard "
            "error of the mean); after grpo 60.0-66.0% (6.0 points apart; mean 62.8% +- 1.2, the standard "
            "error of the mean).") in body
    assert "CPU kernels (ATEN_CPU_CAPABILITY) default, avx2, avx512, " in body
    # One run: no spread to state, no kernel to list.
    single = rn.render("demo", [record("demo", 0, {"before sft": 0.0, "after sft": 0.5, "after grpo": 0.6},
                                       [("sft", 1.0, 0.5)], 2.0)])
    assert "Across these" not in single and "ATEN_CPU_CAPABILITY" not in single


def test_cua_unseen_tasks_are_read_from_the_evaluation_and_shown_in_their_column():
    from types import SimpleNamespace

    from bench.cua_eval import _report

    # 4 episodes: click-test-2 wins once in two (once at the first click), focus-text-2 loses twice.
    eps = [SimpleNamespace(info={"success": True}, failed=False, turns=1),
           SimpleNamespace(info={"success": False}, failed=False, turns=3),
           SimpleNamespace(info={"success": False}, failed=False, turns=3),
           SimpleNamespace(info={"success": True}, failed=True, turns=2)]  # a failed episode never counts
    tasks = ["click-test-2", "click-test-2", "focus-text-2", "focus-text-2"]
    examples = [SimpleNamespace(fields={"miniwob_task": t}) for t in tasks]
    got = rn.parse_cua_eval("loading...\n" + _report("greedy", eps, examples) + "\n12 s, max_turns 3\n")
    assert got == {"success": 0.25, "n": 4, "per_task": {"click-test-2": 0.5, "focus-text-2": 0.0}}
    rec = record("cua_tiny", 0, {"before sft": 0.0, "after sft": 0.3, "after grpo": 0.45},
                 [("sft", 200.0, 0.3), ("grpo", 600.0, 0.45)], 900.0)
    rec["unseen_tasks"] = {"tasks": ["click-test-2", "focus-text-2"], **got}
    row = rn.render("cua_tiny", [rec]).splitlines()[2]
    assert row.split(" | ")[5] == "25.0%"     # before, after SFT, after GRPO, GRPO adds, then the unseen tasks
