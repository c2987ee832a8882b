"""Step-time calibration: the constants of trainfit/plan/steptime.py from GPU measurements.

    .venv/bin/python bench/calibrate.py            # fit, print each case against the fit, change nothing
    .venv/bin/python bench/calibrate.py --write    # and rewrite trainfit/plan/data/efficiency.json
    .venv/bin/python bench/calibrate.py --results bench/results/gpu_<card>_<date>.json --gpu <key> --write

Input: a measurement file shaped like bench/results/gpu_h100_2026-11-22.json: `trainer_runs.cases`
(each a trainer config and its per-step `step_time_s`) and, optionally, `grpo_vs_trl_same_gpu` (the
trainfit and TRL sides of one GRPO configuration, per-step times). Each case is rebuilt and planned
as tests/test_plan_h100.py does (its `build_cases`); the measured step is the median after the first
(warm-up) step.

Derivation (weighted least squares on relative error, so a 0.4 s case counts as much as a 15 s one):
  measured - optimizer = a x (train_flops + prefill_flops) / peak            a = 1 / mm_efficiency
                       + e x (pass_tokens + prefill_tokens) x units_base / bandwidth
                       + l x (pass_tokens + prefill_tokens) x units_lora / bandwidth
                       + p x decode_steps x layers + q x decode_steps x lora_modules
over every case without a quantized base; the decode terms are only non-zero for GRPO cases, so p
and q are set by them. The optimizer is bandwidth-bound at OPTIMIZER_BW of the data-sheet bandwidth
(assumed: 10-40 ms of 0.4-15 s steps, not separable in these runs). Then the QLoRA factor: the
quantized case's measured time over the LoRA estimate of its training. Then `hf-generate` (TRL's
generate on the same GRPO configuration, when the file has it): its decode constants are trainfit's
scaled by (TRL median step - trainfit's estimated non-decode part) / trainfit's estimated decode part,
assuming TRL's training costs what trainfit's does. CUDA-graph and vLLM decoding have no
measurements: written as labelled placeholders.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

OPTIMIZER_BW = 0.5
DEFAULT_RESULTS = ROOT / "bench" / "results" / "gpu_h100_2026-11-22.json"
# Trainer cases that ran the configuration of the file's grpo_vs_trl_same_gpu section (its "how" text):
# their steps are pooled with that section's trainfit steps.
SAME_AS_GRPO_VS_TRL = {"grpo-q05-lora-g8-256"}
# No measurement yet: a captured decode step replays ~20 kernels a layer at a few microseconds each,
# plus ~6 small kernels per unmerged LoRA module; vLLM (CUDA graphs, punica LoRA kernels) alike.
PLACEHOLDERS = {"hf-cudagraph": (5e-5, 1e-5), "vllm": (3e-5, 1e-5)}
UNKNOWNS = ("inv_mm", "elem_bytes", "lora_bytes", "per_layer_s", "per_lora_module_s")


def median_after_warmup(steps: list) -> float:
    return statistics.median(steps[1:]) if len(steps) > 1 else steps[0]


def planned_cases(results: dict, gpu: str) -> list[dict]:
    """Every trainer case planned on `gpu`: name, work summary, measured median step."""
    from test_plan_h100 import bpe_tokenizer, build_cases

    from trainfit.config import validate
    from trainfit.plan import plan

    pooled = [s for r in results.get("grpo_vs_trl_same_gpu", {}).get("runs", []) if r["side"] == "trainfit"
              for s in r["step_time_s"][1:]]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for case, raw in build_cases(Path(tmp), bpe_tokenizer()):
            p = plan(validate(raw), gpu=gpu, suggest=False)
            steps = case["step_time_s"][1:] + (pooled if case["case"] in SAME_AS_GRPO_VS_TRL else [])
            out.append({"case": case["case"], "work": p.work, "measured": statistics.median(steps),
                        "trainer_median": median_after_warmup(case["step_time_s"]), "n_steps": len(steps)})
    return out


def columns(work: dict, card) -> np.ndarray:
    """Coefficients of UNKNOWNS for one case (see the module docstring)."""
    peak, bw = card.bf16_tflops * 1e12, card.bandwidth_gbs * 1e9
    toks = work.get("pass_tokens", 0) + work.get("prefill_tokens", 0)
    steps = work.get("decode_steps", 0)
    return np.array([(work.get("train_flops", 0.0) + work.get("prefill_flops", 0.0)) / peak,
                     toks * work["units_base"] / bw, toks * work["units_lora"] / bw,
                     steps * work["layers"], steps * work["lora_modules"]])


def fit(cases: list[dict], card) -> dict:
    opt = lambda w: w.get("optimizer_bytes", 0.0) / (card.bandwidth_gbs * 1e9 * OPTIMIZER_BW)  # noqa: E731
    rows = [c for c in cases if not c["work"].get("quantized")]
    a = np.array([columns(c["work"], card) / c["measured"] for c in rows])
    b = np.array([(c["measured"] - opt(c["work"])) / c["measured"] for c in rows])
    x, *_ = np.linalg.lstsq(a, b, rcond=None)
    if (x <= 0).any():
        raise ValueError(f"a fitted constant is not positive: {dict(zip(UNKNOWNS, x))}; the model does not "
                         "describe these measurements")
    k = dict(zip(UNKNOWNS, x))
    quant = [c for c in cases if c["work"].get("quantized")]
    k["qlora_factor"] = statistics.median(
        (c["measured"] - opt(c["work"])) / float(columns(c["work"], card)[:3] @ x[:3]) for c in quant) if quant else None
    return k


def loo(cases: list[dict], i: int, card) -> str:
    """Relative error of case i under constants fitted without it (training-only, unquantized cases)."""
    c = cases[i]
    if c["work"].get("quantized") or c["work"].get("decode_steps"):
        return "-"
    try:
        k = fit(cases[:i] + cases[i + 1:], card)
    except ValueError:
        return "needed"  # without it a constant comes out negative: the only case that pins it
    x = np.array([k[u] for u in UNKNOWNS])
    est = float(columns(c["work"], card) @ x) + c["work"]["optimizer_bytes"] / (card.bandwidth_gbs * 1e9 * OPTIMIZER_BW)
    return f"{est / c['measured'] - 1:+.1%}"


def generate_ratio(results: dict, cases: list[dict], k: dict, card) -> tuple[float, float]:
    """(TRL's decode time over trainfit's on the pooled configuration, TRL's median step)."""
    trl = [s for r in results["grpo_vs_trl_same_gpu"]["runs"] if r["side"] == "trl" for s in r["step_time_s"][1:]]
    c = next(c for c in cases if c["case"] in SAME_AS_GRPO_VS_TRL)
    col, x = columns(c["work"], card), np.array([k[u] for u in UNKNOWNS])
    decode = float(col[3:] @ x[3:])
    rest = float(col[:3] @ x[:3]) + c["work"]["optimizer_bytes"] / (card.bandwidth_gbs * 1e9 * OPTIMIZER_BW)
    return (statistics.median(trl) - rest) / decode, statistics.median(trl)


def entry(results_path: Path, results: dict, cases: list[dict], k: dict, card) -> dict:
    rel = str(results_path.resolve().relative_to(ROOT)) if results_path.resolve().is_relative_to(ROOT) else str(results_path)
    date = next((t for t in results_path.stem.split("_") if t[:2] == "20"), str(datetime.date.today()))
    names = {c["case"] for c in cases}
    full = sorted(c["case"] for c in cases if not c["work"].get("quantized"))
    one = lambda v, how, **kw: {"value": float(f"{v:.4g}"), "source": rel, "date": date, "how": how, **kw}  # noqa: E731
    lsq = "least squares on relative error over the fitted cases (bench/calibrate.py)"
    e = {"gpu_name": card.name, "date": date, "source": rel, "derived_by": "bench/calibrate.py", "fitted_cases": full,
         "train": {"mm_efficiency": one(1 / k["inv_mm"], "share of peak bf16 FLOP/s the matmuls reach; " + lsq),
                   "elem_bytes": one(k["elem_bytes"], "bytes moved by elementwise kernels per token, pass and unit "
                                     "of layers x (hidden + intermediate); " + lsq),
                   "lora_bytes": one(k["lora_bytes"], "bytes per token, pass and unit of (in + out) features of "
                                     "each LoRA-adapted linear; " + lsq)},
         "optimizer": {"bw_efficiency": one(OPTIMIZER_BW, "assumed, not measured: the optimizer is 1-3% of "
                                            "these steps and not separable")},
         "decode": {"hf-trainfit": {
             "per_layer_s": one(k["per_layer_s"], "seconds per decode step per layer (Python + launches); " + lsq),
             "per_lora_module_s": one(k["per_lora_module_s"], "seconds per decode step per unmerged LoRA "
                                      "module; " + lsq)}}}
    if k["qlora_factor"]:
        quant = sorted(c["case"] for c in cases if c["work"].get("quantized"))
        e["train"]["qlora_factor"] = one(k["qlora_factor"], f"measured / LoRA estimate of {', '.join(quant)}")
    else:
        e["train"]["qlora_factor"] = one(1.0, "no quantized case measured: placeholder", placeholder=True)
    if "grpo_vs_trl_same_gpu" in results and SAME_AS_GRPO_VS_TRL & names:
        r, med = generate_ratio(results, cases, k, card)
        how = (f"trainfit's constants x {r:.3f}: TRL's median step {med:.2f} s (grpo_vs_trl_same_gpu, steps after "
               "the first) less trainfit's estimated training, over trainfit's estimated decoding")
        e["decode"]["hf-generate"] = {"per_layer_s": one(k["per_layer_s"] * r, how),
                                      "per_lora_module_s": one(k["per_lora_module_s"] * r, how)}
    else:
        e["decode"]["hf-generate"] = {**e["decode"]["hf-trainfit"], "placeholder": True}
    for eng, (layer, lora) in PLACEHOLDERS.items():
        how = "placeholder, not measured (no such run yet): a few microseconds per captured kernel"
        e["decode"][eng] = {"per_layer_s": {"value": layer, "how": how}, "per_lora_module_s": {"value": lora, "how": how},
                            "placeholder": True}
    return e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(DEFAULT_RESULTS))
    ap.add_argument("--gpu", default="h100-80gb", help="catalog key of the card the file was measured on")
    ap.add_argument("--write", action="store_true", help="write the constants into the efficiency file")
    args = ap.parse_args()

    from trainfit.plan import steptime
    from trainfit.plan.hardware import find_gpu

    card = find_gpu(args.gpu)
    path = Path(args.results)
    results = json.loads(path.read_text())
    cases = planned_cases(results, card.key)
    k = fit(cases, card)
    data = json.loads(steptime.EFFICIENCY_FILE.read_text()) if steptime.EFFICIENCY_FILE.exists() else {}
    data.setdefault("about", "Measured efficiency constants of trainfit/plan/steptime.py per GPU (catalog key); "
                    "recomputed by bench/calibrate.py from the measurement file named in each constant.")
    data.setdefault("default", {"from_gpu": card.key, "how": "GPUs never measured use this card's constants on "
                                "their own data-sheet peaks, labelled uncalibrated"})
    data.setdefault("gpus", {})[card.key] = entry(path, results, cases, k, card)
    print(f"{'case':30} {'measured':>9} {'estimate':>9} {'error':>7} {'left out':>9} {'decode ms/step':>15}")
    for i, c in enumerate(cases):
        const = data["gpus"][card.key]
        est = steptime.estimate_with(c["work"], card, 1, const).total
        ph = steptime.phase_seconds(c["work"], card, const)
        dec = f"{1e3 * ph['decode'] / c['work']['decode_steps']:.1f}" if c["work"].get("decode_steps") else "-"
        print(f"{c['case']:30} {c['measured']:9.3f} {est:9.3f} {est / c['measured'] - 1:+7.1%} "
              f"{loo(cases, i, card):>9} {dec:>15}")
    print("left out: the error when this case is left out of the fit (training-only cases; the GRPO and "
          "QLoRA cases each set their own constants; `needed`: no positive fit without it)")
    print(json.dumps(data["gpus"][card.key], indent=1)[:4000] if not args.write else "")
    if args.write:
        steptime.EFFICIENCY_FILE.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {steptime.EFFICIENCY_FILE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
