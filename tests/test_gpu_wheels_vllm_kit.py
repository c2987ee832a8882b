"""The vLLM kit's pieces that need no network: what it drops, and parts that are cut, verified one by one,
joined and unpacked (bench/gpu_vllm_kit.py; building it downloads vllm, `make gpu-vllm-kit`)."""

import hashlib
import io
import json
import lzma
import random
import tarfile

import pytest

from bench import gpu_vllm_kit as kit


def test_drops_fa2_fa4_and_moe_kernels_but_keeps_fa3_and_the_core_ops():
    assert "FlashAttention-2" in kit.dropped("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
    assert kit.dropped("vllm/vllm_flash_attn/cute/interface.py")        # a folder drop covers its files
    assert kit.dropped("vllm/third_party/deep_gemm/include/deep_gemm/x.cuh")
    assert kit.dropped("vllm/_moe_C_stable_libtorch.abi3.so")
    for kept in ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so",
                 "vllm/cumem_allocator.abi3.so", "vllm/vllm_flash_attn/flash_attn_interface.py",
                 "vllm/vllm-rs-notes.txt"):   # an exact-file drop is not a prefix
        assert kit.dropped(kept) is None, kept


def _kit(tmp_path, monkeypatch, size=700):
    """A small site tree packed as the build packs it, cut into parts of `size` bytes, with its manifest."""
    buf = io.BytesIO()
    rng = random.Random(0)   # incompressible: the archive is a few kB, several parts
    files = {f"pkg/mod{i}.py": rng.randbytes(300 * (i + 1)) for i in range(4)}
    with lzma.open(buf, "wb", preset=0) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    monkeypatch.setattr(kit, "part_size", lambda: size)
    out = tmp_path / "kit"
    out.mkdir()
    parts, limit = kit.split(data, out)
    (out / "MANIFEST.json").write_text(json.dumps({"parts": parts, "archive_sha256": hashlib.sha256(data).hexdigest(),
                                                  "env": kit.ENV, "part_limit_bytes": limit}))
    return out, files, parts


def test_parts_are_verified_one_by_one_then_joined_and_unpacked(tmp_path, monkeypatch):
    out, files, parts = _kit(tmp_path, monkeypatch)
    assert len(parts) >= 2 and all(p["bytes"] <= 700 for p in parts)
    assert kit.verify_part(out, 2) == {"part": 2, "of": len(parts), "file": parts[1]["file"], "ok": True,
                                       "present": [p["file"] for p in parts]}
    site = tmp_path / "site"
    res = kit.install(out, site)
    assert res["installed"] is True and res["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    for name, data in files.items():
        assert (site / name).read_bytes() == data
    assert kit.install(out, site)["note"] == "already installed"   # the stamp holds the archive's sha256


def test_a_missing_or_corrupt_part_is_named_and_nothing_is_installed(tmp_path, monkeypatch):
    out, _, parts = _kit(tmp_path, monkeypatch)
    (out / parts[0]["file"]).write_bytes(b"x" + (out / parts[0]["file"]).read_bytes()[1:])
    (out / parts[-1]["file"]).unlink()
    assert kit.verify_part(out, 1)["ok"] is False
    res = kit.install(out, tmp_path / "site")
    assert res["installed"] is False and parts[0]["file"] in res["note"] and parts[-1]["file"] in res["note"]
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize("size", [1000, 10_000_000])
def test_resplit_cuts_the_same_archive_again(tmp_path, monkeypatch, size):
    out, files, _ = _kit(tmp_path, monkeypatch, size=700)
    monkeypatch.setattr(kit, "part_size", lambda: size)
    m = kit.resplit(out)
    total = len(b"".join((out / p["file"]).read_bytes() for p in m["parts"]))
    assert len(m["parts"]) == -(-total // size) and sorted(out.glob("vllm-kit.tar.xz.part*")) == \
        [out / p["file"] for p in m["parts"]]   # the old, shorter parts are gone
    assert kit.install(out, tmp_path / "site")["installed"] is True
