"""The architecture of a GGUF base, read from the file's metadata as transformers reads it.

A GGUF file carries its architecture (layers, heads, sizes, vocabulary) as metadata; transformers
maps it to a config (`AutoConfig.from_pretrained(folder, gguf_file=...)`, which reads no tensor),
and `trainfit train` loads the same file with that config. So the planner plans the config
transformers reads, exactly as it plans a Hugging Face config.json.

What the run holds is not what the file stores: transformers dequantizes every tensor (Q4_K, Q8_0,
...) on load (models._gguf_dequantized), into `model.dtype`, so the weights are planned in
model.dtype like any other base, and the plan's note says what the file held. Loading keeps the
dequantized state dict in CPU RAM while the model is built (load_gguf_checkpoint converts each
tensor to the dtype as it goes), so about the weights' size of CPU RAM at load, said in the note too.

The result is cached on disk by the file's path, size and mtime (cache.py), so a warm plan of a
GGUF base reads neither the file nor transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from trainfit.config import ConfigError
from trainfit.core import cache

GiB = 1024 ** 3
_MEMO: dict[str, dict] = {}


def split(name: str, gguf_file: Optional[str]) -> tuple[str, Optional[str]]:
    """'dir/model.gguf' -> ('dir', 'model.gguf'); a folder or hub id with model.gguf_file passes
    through (the split models._split_gguf makes for loading)."""
    if name.endswith(".gguf"):
        p = Path(os.path.expanduser(name))
        return str(p.parent), p.name
    return name, gguf_file


def read_gguf(name: str, gguf_file: Optional[str], revision: Optional[str] = None) -> dict:
    """{"config": transformers config dict, "tensors": {ggml type: elements}, "file_bytes": n, "path"}
    of a GGUF base: a .gguf path, or a folder / hub id (already in the local cache) with gguf_file."""
    folder, file = split(name, gguf_file)
    path = _local_path(name, folder, file, revision)
    st = os.stat(path)
    key = cache.stable_hash({"gguf": [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]})
    if key in _MEMO:
        return _MEMO[key]
    found = cache.read("gguf", key)
    if found is None:
        found = _read(name, path)
        cache.write("gguf", key, found)
    _MEMO[key] = found
    return found


def _local_path(name: str, folder: str, file: str, revision: Optional[str]) -> str:
    local = Path(os.path.expanduser(folder)) / file
    if local.is_file():
        return str(local)
    if name.endswith(".gguf") or Path(os.path.expanduser(folder)).is_dir():
        raise ConfigError(f"model.name={name!r}: GGUF file {str(local)!r} not found; give the path to an existing "
                          ".gguf file (or a folder and model.gguf_file naming a file in it).")
    try:  # a hub id: only a file already in the local Hugging Face cache (the planner downloads nothing)
        from transformers.utils import cached_file

        path = cached_file(folder, file, revision=revision, local_files_only=True)
    except (OSError, ValueError, ImportError):
        path = None
    if not path:
        raise ConfigError(f"model.gguf_file={file!r} of model.name={name!r} is not in the local Hugging Face cache; "
                          "the planner reads the architecture from the GGUF file and downloads nothing: download it "
                          f"first (hf download {folder} {file}) or set model.name to the local .gguf path.")
    return path


def _read(name: str, path: str) -> dict:
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(f"model.name={name!r} is a GGUF file, and reading it needs the `gguf` package: pip install "
                          "'trainfit[gguf]' (train needs it too).") from None
    p = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    except (ValueError, KeyError) as e:  # an architecture transformers cannot map, which train cannot load either
        raise ConfigError(f"model.name={name!r}: transformers cannot read this GGUF file's architecture ({e}); "
                          "train cannot load it either. Use the original model (hub id or directory).") from None
    raw = config.to_dict()
    for k in [k for k in raw if k.startswith("_") or k == "transformers_version"]:
        raw.pop(k)
    return {"config": raw, "tensors": _tensor_types(p), "file_bytes": p.stat().st_size, "path": str(p)}


def _tensor_types(path: Path) -> dict[str, int]:
    """Elements stored per ggml type (F32, F16, Q8_0, Q4_K, ...); the reader maps the file, reads no data."""
    from gguf import GGUFReader

    out: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        kind = getattr(t.tensor_type, "name", str(t.tensor_type))
        out[kind] = out.get(kind, 0) + int(t.n_elements)
    return out


def eos_token_id(name: str, gguf_file: Optional[str], revision: Optional[str] = None) -> Optional[int]:
    """The end-of-sequence id the GGUF's tokenizer metadata names (tokenizer.ggml.eos_token_id), or None.
    Some transformers releases build a GGUF's tokenizer with the tokenizer class's default eos instead
    (Qwen2's <|endoftext|> where a chat model's file says <|im_end|>); load_tokenizer sets this one."""
    from gguf import GGUFReader, Keys

    folder, file = split(name, gguf_file)
    field = GGUFReader(_local_path(name, folder, file, revision)).fields.get(Keys.Tokenizer.EOS_ID)
    return None if field is None else int(field.parts[field.data[0]][0])


def load_note(info: dict, dtype: str, dtype_bytes: int, quantization: str = "none") -> str:
    """What the file holds and what the run holds instead (the dequantized weights), for the plan's notes."""
    tensors = info["tensors"]
    total = sum(tensors.values()) or 1
    kinds = ", ".join(f"{k} {n / total:.0%}" if n / total >= 0.005 else f"{k} <1%"
                      for k, n in sorted(tensors.items(), key=lambda kv: -kv[1]))
    then = f" and model.quantization={quantization} then quantizes its linears" if quantization != "none" else ""
    return (f"GGUF base {Path(info['path']).name}: {kinds} of its {total:,} stored elements, "
            f"{_size(info['file_bytes'])} on disk. transformers dequantizes every tensor to {dtype} on "
            f"load{then}, so the run holds what is planned here, not the file's encoding; loading holds the "
            f"dequantized weights in CPU RAM once (~{_size(total * dtype_bytes)}).")


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"
