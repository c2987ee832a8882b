"""The vLLM kit: vllm 0.25.1 trimmed to a dense bf16 model on Hopper, plus the small packages the GPU image
lacks, in parts of at most 60 MiB that successive device calls carry (one part a call; bench/NOTES.md).

    make gpu-vllm-kit                          # here (PyPI): .gpu-kit/vllm/ parts + MANIFEST.json
    python3 -m bench.gpu_vllm_kit --part N     # there, in the call that carried part N: its sha256
    python3 -m bench.gpu_vllm_kit --install    # there: every part verified, joined, unpacked into SITE
    python3 -m bench.gpu_vllm_kit --check      # vllm imported as far as the machine allows -> JSON

The GPU image has torch 2.11.0+cu130, torchvision 0.26.0 and transformers 5.17.0, exactly what vllm 0.25.1
requires, and no vllm. Its wheel unpacks to ~590 MB; what trainfit's engine (trainfit/rollout/vllm_engine.py:
LLM(...) in process, generate with processed log-probs, sleep / wake_up, load_weights / reload_weights,
LoRA adapters) runs on for a dense model on SM90 is its Python, _C_stable_libtorch (norms, rotary, cache
ops), the FlashAttention-3 kernels and cumem_allocator (sleep mode). DROP lists what goes, each with the
vllm code that shows it is not reached; SKIP_DEPS the requirements left out, likewise. The parts are one
tar.xz cut in pieces (xz: Python's lzma unpacks it there, no zstd needed).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

from bench.gpu_wheels import BUDGET, IMAGE, ROOT, WANTED, download, image_satisfies, repo_bytes, requires

VERSION = "0.25.1"
OUT = ROOT / ".gpu-kit" / "vllm"
SITE = Path(tempfile.gettempdir()) / "trainfit-vllm-site"
PART_BYTES = 60 * 2**20
MARGIN = 2 * 2**20   # a call carries a part beside the repository's own files (~6 MiB): 64 MiB in all
RESULT = ROOT / "bench" / "results" / "vllm_kit_cpu_check.json"
# Paths under the unpacked wheel (prefixes), with the vllm code that shows the engine's path never reaches them.
DROP = [
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
     "FlashAttention-2: on SM90 fa_utils.get_flash_attn_version picks 3 when is_fa_version_supported(3); "
     "flash_attn_interface.py imports _vllm_fa2_C in a try (FA2_AVAILABLE=False) and the FA3 path "
     "(flash_attn_varlen_func, get_scheduler_metadata) calls torch.ops._vllm_fa3_C only"),
    ("vllm/vllm_flash_attn/cute/",
     "FlashAttention-4 (CuTe DSL, needs nvidia-cutlass-dsl): FA4_AVAILABLE is whether cute/interface.py exists "
     "(flash_attn_interface.py); on SM90 get_flash_attn_version upgrades 3 -> 4 only for head_size > 256, "
     "diff-KV sinks or diffusion models"),
    ("vllm/_moe_C_stable_libtorch.abi3.so",
     "MoE kernels: platforms/cuda.py import_kernels imports it under contextlib.suppress(ImportError); its ops "
     "(torch.ops._moe_C.*) are called only from _custom_ops' moe_* / topk_* / grouped_topk and fused_moe"),
    ("vllm/third_party/deep_gemm/",
     "DeepGEMM (FP8 block GEMMs and MoE, with 28 MB of CUTLASS headers): utils/deep_gemm._import_deep_gemm "
     "imports it lazily; has_deep_gemm() is False without it; a bf16 dense model never calls it"),
    ("vllm/third_party/fmha_sm100/",
     "Blackwell (SM100) sparse attention with CUTLASS headers: imported function-locally by "
     "models/minimax_m3 only"),
    ("vllm/third_party/flashmla/",
     "FlashMLA (DeepSeek MLA): v1/attention/ops/flashmla.py imports it in a try; MLA backends only"),
    ("vllm/_flashmla_C.abi3.so", "FlashMLA kernels (MLA models only; see third_party/flashmla)"),
    ("vllm/_flashmla_extension_C.abi3.so", "FlashMLA kernels (MLA models only)"),
    ("vllm/_qutlass_C.abi3.so",
     "FP4 (NVFP4 / MXFP4) quantization kernels: platforms/cuda.py imports it under "
     "contextlib.suppress(ImportError); _custom_ops raises only when an FP4 op is called"),
    ("vllm/vllm-rs",
     "Rust API-server frontend binary: envs.py resolves it only for VLLM_RUST_FRONTEND_PATH, v1/utils.py "
     "launches it for `vllm serve`; the offline LLM never does"),
    ("vllm/_rust_tool_parser.abi3.so",
     "tool-call parsers of the OpenAI server: tool_parsers/rust_tool_parser.py imports it on use only"),
]
# vllm's Requires-Dist that the kit does not carry, and why (the others the image lacks are carried).
SKIP_DEPS = {
    "flashinfer-python": "on SM90 FLASH_ATTN precedes FLASHINFER (platforms/cuda.py _get_backend_priorities); "
                         "the sampler takes it only without processed log-probs (v1/sample/ops/topk_topp_sampler.py; "
                         "trainfit asks for processed_logprobs, and the kit's environment sets "
                         "VLLM_USE_FLASHINFER_SAMPLER=0 for other callers); utils/flashinfer.has_flashinfer() "
                         "is a find_spec guard. With flashinfer-cubin 472 MB",
    "flashinfer-cubin": "FlashInfer's precompiled kernels (458 MB): see flashinfer-python",
    "mistral-common": "Mistral tokenizers (36 MB of tokenizer data): tokenizers/registry.py imports "
                      "vllm.tokenizers.mistral only for tokenizer_mode=mistral or a Mistral repository; it also "
                      "requires numpy<2.4 on Python 3.12, and the image has numpy 2.5.2",
    "tilelang": "model_executor/kernels/mhc (DeepSeek-V4 hyper-connections) only, behind has_tilelang()",
    "nvidia-cutlass-dsl": "CuTe DSL kernels: FA4 (dropped), mamba GDN, DSA indexer, Blackwell paths; imported "
                          "function-locally (v1/attention/backends/flash_attn.py imports cutlass only in FA4's mask)",
    "quack-kernels": "CuTe DSL kernels (mamba GDN, DSA indexer): not a dense model's path",
    "tokenspeed-mla": "MLA decode kernels (platforms/cuda.py lists TOKENSPEED_MLA for use_mla only)",
    "humming-kernels": "quantized-GEMM kernels: no import in vllm's own code; bf16 weights",
    "torchcodec": "video / audio decoding of multimodal inputs (multimodal/media); text and image prompts only",
    "pynvvideocodec": "NVIDIA video decoding of multimodal video inputs (43 MB)",
    "fastsafetensors": "load_format=fastsafetensors only; trainfit loads the default safetensors",
    "nvidia-cudnn-frontend": "cuDNN ViT prefill through flashinfer (v1/attention/ops/vit_attn_wrappers.py)",
    "nvtx": "profiling ranges, imported in v1/utils.py only when NVTX tracing is enabled",
    "prometheus-fastapi-instrumentator": "the API server's metrics",
    "watchfiles": "the API server's reload",
    "anthropic": "the Anthropic-compatible API server",
    "mcp": "the API server's tool servers",
    "model-hosting-container-standards": "SageMaker serving hooks of the API server",
    "opentelemetry-sdk": "request tracing (--otlp-traces-endpoint), imported only when tracing is enabled",
    "opentelemetry-api": "request tracing, see opentelemetry-sdk",
    "opentelemetry-exporter-otlp": "request tracing, see opentelemetry-sdk",
    "opentelemetry-semantic-conventions-ai": "request tracing, see opentelemetry-sdk",
}
# Versions other than the first match: xgrammar (imported on the LLM path, vllm/v1/structured_output) 0.2.9
# needs apache-tvm-ffi >= 0.1.11 and fails to load on vllm's pinned 0.1.9 (load_lib_module's extra_lib_paths);
# the xgrammar that accepts 0.1.9 (0.2.5.post1) is a 47 MB wheel (123 MB unpacked) against 0.2.9's 1.3 MB.
# The pin is for FlashInfer, which is not carried; vllm's own code imports tvm_ffi only in FA4 (dropped).
PINS = {"apache-tvm-ffi": "apache-tvm-ffi==0.1.15.post2"}
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}   # FlashInfer is not carried (SKIP_DEPS): never reach for it
# What --check imports, in the order trainfit's engine reaches them (stops are recorded, not fatal).
MODULES = [
    "vllm", "vllm.engine.arg_utils", "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.inputs",
    "vllm.lora.request", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor", "vllm.device_allocator.cumem", "vllm.model_executor.model_loader.reload",
    "vllm.model_executor.models.qwen2", "vllm.model_executor.models.qwen3", "vllm.model_executor.models.llama",
    "vllm.v1.sample.sampler", "vllm.v1.attention.backends.fa_utils", "vllm.platforms.cuda",
    "vllm.v1.attention.backends.flash_attn", "vllm.vllm_flash_attn", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.lora.layers",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dropped(rel: str) -> str | None:
    return next((why for prefix, why in DROP if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix))),
                None)


def carried_by_wheels_kit(r) -> bool:
    """make gpu-wheels installs its wheels beside the kit (pydantic, starlette...): one version of each."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    for req, *_ in WANTED:
        q = Requirement(req)
        if canonicalize_name(q.name) == canonicalize_name(r.name):
            return r.specifier.contains(Version(next(iter(q.specifier)).version), prereleases=True)
    return False


def in_wheels_kit(name: str) -> bool:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return any(canonicalize_name(Requirement(req).name) == name for req, *_ in WANTED)


def collect_deps(vllm_wheel: Path, dest: Path) -> tuple[list[dict], list[dict]]:
    """vllm's requirements the image and the wheels kit lack, and theirs, minus SKIP_DEPS (recorded)."""
    from packaging.utils import canonicalize_name

    carried, skipped, seen = [], [], set()
    queue = [(r, "vllm") for r in requires(vllm_wheel)]
    while queue:
        r, parent = queue.pop(0)
        name = canonicalize_name(r.name)
        if name in seen:
            continue
        seen.add(name)
        if name in IMAGE or in_wheels_kit(name):
            # never a second copy of what the image or the wheels kit has (numpy, torch...): one version each
            if not (image_satisfies(r) or carried_by_wheels_kit(r)):
                skipped.append({"name": name, "requirement": str(r), "needed_by": parent,
                                "why": "on the image (or in make gpu-wheels) at another version: that one is used"})
            continue
        if name in SKIP_DEPS:
            skipped.append({"name": name, "requirement": str(r), "needed_by": parent, "why": SKIP_DEPS[name]})
            continue
        wheel = download(PINS.get(name, f"{r.name}{r.specifier}"), dest)
        carried.append({"name": name, "requirement": str(r), "needed_by": parent, "wheel": wheel.name,
                        "bytes": wheel.stat().st_size})
        queue += [(q, name) for q in requires(wheel)]
    return carried, skipped


def conflicts(deps: list[dict], wheels: Path) -> list[str]:
    """Requirements between carried packages that the carried versions break (one version each is kept)."""
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    version = {d["name"]: Version(d["wheel"].split("-")[1]) for d in deps}
    return [f"{d['name']} needs {r}, carried {version[canonicalize_name(r.name)]}" for d in deps
            for r in requires(wheels / d["wheel"])
            if canonicalize_name(r.name) in version and not r.specifier.contains(version[canonicalize_name(r.name)],
                                                                                 prereleases=True)]


def unpack_wheel(wheel: Path, tree: Path, drops: list) -> int:
    """A wheel unzipped into a site tree is installed (purelib / platlib data folded in); returns bytes kept."""
    kept = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            rel = info.filename
            if ".data/" in rel.split("/", 1)[0] + "/":
                parts = rel.split("/")
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue   # scripts / headers / data: nothing the engine imports
                rel = "/".join(parts[2:])
            if info.is_dir():
                continue
            why = dropped(rel)
            if why:
                drops.append({"path": rel, "bytes": info.file_size, "why": why})
                continue
            target = tree / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if info.external_attr >> 16 & 0o111:
                target.chmod(0o755)
            kept += info.file_size
    return kept


def build(out: Path, preset: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wheels, tree = tmp / "wheels", tmp / "site"
        wheels.mkdir()
        vllm_wheel = download(f"vllm=={VERSION}", wheels)
        deps, skipped = collect_deps(vllm_wheel, wheels)
        drops: list[dict] = []
        kept = unpack_wheel(vllm_wheel, tree, drops)
        for d in deps:
            d["unpacked_bytes"] = unpack_wheel(wheels / d["wheel"], tree, drops)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        blob = tmp / "vllm-kit.tar.xz"
        with lzma.open(blob, "wb", preset=preset) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            for f in sorted(tree.rglob("*")):
                tar.add(f, arcname=str(f.relative_to(tree)), recursive=False)
        parts, size = split(blob.read_bytes(), out)
        unpacked = sum(f.stat().st_size for f in tree.rglob("*") if f.is_file())
        manifest = {
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "vllm": VERSION,
            "wheel": vllm_wheel.name, "wheel_bytes": vllm_wheel.stat().st_size,
            "vllm_unpacked_kept_bytes": kept, "unpacked_bytes": unpacked, "archive_bytes": blob.stat().st_size,
            "archive_sha256": sha256(blob), "parts": parts, "part_limit_bytes": size,
            "dropped": drops, "dropped_bytes": sum(d["bytes"] for d in drops), "deps": deps, "deps_skipped": skipped,
            "conflicts": conflicts(deps, wheels),
            "env": ENV, "site": str(SITE)}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def part_size() -> int:
    """At most 60 MiB, and what a device call's 64 MiB leave beside the repository's files."""
    return min(PART_BYTES, BUDGET - repo_bytes() - MARGIN)


def split(data: bytes, out: Path) -> tuple[list[dict], int]:
    """The archive cut into out/vllm-kit.tar.xz.partNN (earlier parts removed); their sizes and sha256."""
    size = part_size()
    for old in out.glob("vllm-kit.tar.xz.part*"):
        old.unlink()
    parts = []
    for i in range(0, len(data), size):
        chunk = data[i:i + size]
        p = out / f"vllm-kit.tar.xz.part{i // size + 1:02d}"
        p.write_bytes(chunk)
        parts.append({"file": p.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return parts, size


def resplit(kit: Path) -> dict:
    """Cut the built archive again (the repository grew, say) without building it again."""
    m = json.loads((kit / "MANIFEST.json").read_text())
    data = b"".join((kit / p["file"]).read_bytes() for p in m["parts"])
    if hashlib.sha256(data).hexdigest() != m["archive_sha256"]:
        raise SystemExit(f"the parts in {kit} do not join into the manifest's archive: make gpu-vllm-kit again")
    m["parts"], m["part_limit_bytes"] = split(data, kit)
    (kit / "MANIFEST.json").write_text(json.dumps(m, indent=1))
    return m


def verify_part(kit: Path, n: int) -> dict:
    m = json.loads((kit / "MANIFEST.json").read_text())
    part = m["parts"][n - 1]
    p = kit / part["file"]
    ok = p.is_file() and sha256(p) == part["sha256"]
    return {"part": n, "of": len(m["parts"]), "file": part["file"], "ok": ok,
            "present": sorted(q.name for q in kit.glob("vllm-kit.tar.xz.part*"))}


def install(kit: Path = OUT, site: Path = SITE) -> dict:
    """Verify every part, join them, unpack into `site` (once: a stamp holds the archive's sha256)."""
    mf = kit / "MANIFEST.json"
    if not mf.is_file():
        return {"installed": False, "note": f"no {mf} (make gpu-vllm-kit here, then carry its parts)"}
    m = json.loads(mf.read_text())
    stamp = site / ".vllm-kit"
    if stamp.is_file() and stamp.read_text() == m["archive_sha256"]:
        return {"installed": True, "site": str(site), "note": "already installed"}
    bad = [p["file"] for p in m["parts"] if not (kit / p["file"]).is_file() or sha256(kit / p["file"]) != p["sha256"]]
    if bad:
        return {"installed": False, "note": f"parts missing or corrupt: {bad}; carry them (bench/NOTES.md)"}
    t0 = time.time()
    data = b"".join((kit / p["file"]).read_bytes() for p in m["parts"])
    if hashlib.sha256(data).hexdigest() != m["archive_sha256"]:
        return {"installed": False, "note": "the joined archive's sha256 differs from the manifest's"}
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        tar.extractall(site, filter="tar")
    stamp.write_text(m["archive_sha256"])
    return {"installed": True, "site": str(site), "seconds": round(time.time() - t0, 1), "env": m["env"]}


CHECK = """
import importlib, json, sys, time, traceback
rows = []
for name in sys.argv[1].split(","):
    t0 = time.time()
    try:
        importlib.import_module(name)
        rows.append({"module": name, "ok": True, "seconds": round(time.time() - t0, 2)})
    except BaseException as e:
        tb = traceback.extract_tb(e.__traceback__)
        rows.append({"module": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}",
                     "missing": getattr(e, "name", None), "where": f"{tb[-1].filename}:{tb[-1].lineno}" if tb else None})
facts = {}
try:
    from vllm.vllm_flash_attn import flash_attn_interface as fa
    facts["fa3_available"], facts["fa3_unavailable_reason"] = fa.FA3_AVAILABLE, fa.FA3_UNAVAILABLE_REASON
    facts["fa2_available"], facts["fa4_available"] = fa.FA2_AVAILABLE, fa.FA4_AVAILABLE
except BaseException as e:
    facts["fa_interface"] = f"{type(e).__name__}: {str(e)[:200]}"
import importlib.metadata as md
facts["dists"] = {}
for n in ("torch", "torchvision", "transformers", "tokenizers", "numpy", "pydantic", "triton", "xgrammar",
          "apache-tvm-ffi", "openai", "msgspec", "pyzmq", "uvloop", "fastapi", "numba"):
    try:
        facts["dists"][n] = md.version(n)
    except md.PackageNotFoundError:
        facts["dists"][n] = None
facts["left_out_but_imported"] = sorted(m for m in ("flashinfer", "mistral_common", "tilelang", "cutlass", "quack",
                                                    "anthropic", "mcp", "deep_gemm", "vllm._moe_C_stable_libtorch")
                                        if m in sys.modules)
try:
    import torch, transformers, vllm
    from vllm.platforms import current_platform
    facts.update(vllm=vllm.__version__, vllm_file=vllm.__file__, torch=torch.__version__,
                 transformers=transformers.__version__, cuda=torch.cuda.is_available(),
                 platform=type(current_platform).__name__)
    from vllm import LLM, SamplingParams
    facts["LLM_SamplingParams"] = True
    from vllm.engine.arg_utils import EngineArgs
    facts["EngineArgs_kv_cache_memory_bytes"] = "kv_cache_memory_bytes" in EngineArgs.__dataclass_fields__
    facts["EngineArgs_logprobs_mode"] = "logprobs_mode" in EngineArgs.__dataclass_fields__
    if torch.cuda.is_available():
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        facts["capability"] = str(current_platform.get_device_capability())
        facts["flash_attn_version"] = get_flash_attn_version()
except BaseException as e:
    facts["stopped"] = f"{type(e).__name__}: {str(e)[:300]}"
print("@@" + json.dumps({"modules": rows, "facts": facts}))
"""


def check(python: str, site: Path | None, out: Path | None, env: dict | None = None, timeout: float = 600) -> dict:
    """Import MODULES in a fresh interpreter with `site` first on the path; each import's result."""
    env = dict(env or os.environ, **ENV)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    t0 = time.time()
    try:
        p = subprocess.run([python, "-c", CHECK, ",".join(MODULES)], env=env, capture_output=True, text=True,
                           timeout=timeout)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = None, "", f"timed out after {timeout:.0f} s: {(e.stderr or b'')[-1500:]!r}"
    line = next((s for s in stdout.splitlines() if s.startswith("@@")), None)
    doc = json.loads(line[2:]) if line else {"modules": [], "facts": {"stopped": stderr[-2000:]}}
    first_stop = next((r for r in doc["modules"] if not r["ok"]), None)
    doc.update(python=python, site=str(site) if site else None, seconds=round(time.time() - t0, 1), rc=rc,
               imported=[r["module"] for r in doc["modules"] if r["ok"]], first_stop=first_stop,
               missing_packages=sorted({r["missing"] for r in doc["modules"] if not r["ok"] and r.get("missing")}),
               created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kit", default=str(OUT), help="where the parts and MANIFEST.json are")
    ap.add_argument("--part", type=int, help="verify the sha256 of part N (the call that carried it)")
    ap.add_argument("--install", action="store_true", help="verify, join and unpack the parts into --site")
    ap.add_argument("--check", action="store_true", help="install if needed, then import vllm as far as it goes")
    ap.add_argument("--site", default=str(SITE))
    ap.add_argument("--python", default=sys.executable, help="the interpreter --check imports with")
    ap.add_argument("--out", default="", help="--check's JSON (default bench/results/vllm_kit_cpu_check.json)")
    ap.add_argument("--preset", type=int, default=6, help="xz preset when building")
    ap.add_argument("--resplit", action="store_true", help="cut the built archive again to fit beside the repository")
    args = ap.parse_args(argv)
    kit, site = Path(args.kit), Path(args.site)
    if args.part:
        res = verify_part(kit, args.part)
        print(json.dumps(res))
        return 0 if res["ok"] else 1
    if args.install or args.check:
        res = install(kit, site)
        print(json.dumps(res))
        if not res["installed"]:
            return 1
        if args.check:
            from bench.gpu_check import SITE as WHEELS   # make gpu-wheels' packages (pydantic...), where installed

            doc = check(args.python, site, Path(args.out) if args.out else RESULT,
                        env=None if not WHEELS.is_dir() else {**os.environ, "PYTHONPATH": os.pathsep.join(
                            [str(WHEELS), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])})
            doc["install"] = res
            for r in doc["modules"]:
                print(f"{'ok  ' if r['ok'] else 'STOP'} {r['module']}" + ("" if r["ok"] else f"  {r['error'][:160]}"))
            print(json.dumps(doc["facts"]))
        return 0
    m = resplit(kit) if args.resplit else build(kit, args.preset)
    mib = 2**20
    print(f"vllm {VERSION}: wheel {m['wheel_bytes'] / mib:.0f} MiB; dropped {m['dropped_bytes'] / mib:.0f} MiB "
          f"({len(m['dropped'])} files); kept {m['unpacked_bytes'] / mib:.0f} MiB unpacked (vllm "
          f"{m['vllm_unpacked_kept_bytes'] / mib:.0f}, {len(m['deps'])} packages); archive "
          f"{m['archive_bytes'] / mib:.1f} MiB in {len(m['parts'])} part(s) of <= {m['part_limit_bytes'] / mib:.1f} MiB "
          f"(the repository's files travel beside each)")
    for d in m["deps_skipped"]:
        print(f"   not carried: {d['name']} ({d['requirement']}): {d['why']}")
    for c in m.get("conflicts", []):
        print(f"   CONFLICT: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
