"""`trainfit serve` in-process: routes, seeded sampling, log-probs, batching, errors, auth, adapters."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import tiny_config
from trainfit.app.cli import app
from trainfit.config import ConfigError, ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.models.save import save_pretrained
from trainfit.rollout.hf import HFEngine
from trainfit.app.serve.app import create_app
from trainfit.app.serve.policy import ServedPolicy, load_served_policy, resolve_run_dir

CPU = torch.device("cpu")
PROMPT = [19, 13, 20, 31]


@pytest.fixture(scope="module")
def policy():
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU)
    return ServedPolicy(lm.model, lm.tokenizer, "tiny", source="preset:tiny")


@pytest.fixture(scope="module")
def client(policy):
    with TestClient(create_app(policy, max_batch=16, batch_wait_ms=5)) as c:
        yield c


def complete(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "logprobs": 0,
                                             "return_tokens_as_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def ids_and_logprobs(choice):
    lp = choice["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]


def test_health_and_models(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"]
    assert models[0]["max_model_len"] == 512 and models[0]["parent"] is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_seeded_completion_matches_hf_engine(client, policy, temperature):
    out = complete(client, seed=7, temperature=temperature)
    ids, lps = ids_and_logprobs(out["choices"][0])
    again, _ = ids_and_logprobs(complete(client, seed=7, temperature=temperature)["choices"][0])
    other, _ = ids_and_logprobs(complete(client, seed=8, temperature=temperature)["choices"][0])
    assert ids == again and ids != other  # the seed decides the sample, and it matters
    # The same model through the trainer's engine: same tokens, log softmax(logits / T) within 1e-4.
    ref = HFEngine(policy.model, policy.tokenizer, RolloutConfig(max_new_tokens=6, temperature=temperature)
                   ).generate([PROMPT], seeds=[7], logprobs=True)[0]
    assert ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(lps, ref.logprobs)) < 1e-4
    n = len(ids)
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
    ended = ref.finished  # eos (kept in the ids) before the limit, else the 6-token limit
    assert out["choices"][0]["finish_reason"] == ("stop" if ended else "length") and (ended or n == 6)


def test_text_prompts_and_n(client, policy):
    out = client.post("/v1/completions", json={"prompt": ["12+7=", "3+4="], "n": 2, "max_tokens": 3,
                                               "seed": 1}).json()
    tok = policy.tokenizer
    assert len(out["choices"]) == 4 and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == len(tok("12+7=").input_ids) + len(tok("3+4=").input_ids)
    assert out["usage"]["completion_tokens"] == 12
    assert out["choices"][0]["text"] != out["choices"][1]["text"]  # each of the n choices has its own seed
    assert all(c["logprobs"] is None for c in out["choices"])      # not asked for


def test_chat_completion_uses_chat_template(client, policy):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "seed": 3,
                                                    "logprobs": True}).json()
    tok = policy.tokenizer
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    assert out["object"] == "chat.completion" and out["usage"]["prompt_tokens"] == len(prompt)
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] and all(c["logprob"] < 0 for c in content)
    # The same templated ids through /v1/completions with the same seed give the same text.
    plain = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "seed": 3}).json()
    assert plain["choices"][0]["text"] == msg["content"]


def test_stop_string_cuts_text_and_sets_finish_reason(client, policy):
    full = complete(client, seed=11, max_tokens=12)
    ids, _ = ids_and_logprobs(full["choices"][0])
    pieces = [policy.tokenizer.decode([t]) for t in ids]
    k = next(i for i, s in enumerate(pieces) if i > 0 and s.strip() and s not in "".join(pieces[:i]))
    cut = complete(client, seed=11, max_tokens=12, stop=[pieces[k]])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == "".join(pieces[:k])
    kept = complete(client, seed=11, max_tokens=12, stop=pieces[k], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"].endswith(pieces[k]) and ids_and_logprobs(kept)[0] == ids[:k + 1]


def test_concurrent_requests_share_generate_calls(policy):
    app = create_app(policy, max_batch=64, batch_wait_ms=300)
    batcher = app.state.batcher
    bodies = [{"prompt": PROMPT[: 2 + i % 3], "max_tokens": 4, "seed": 100 + i, "temperature": 1.0 if i % 2 else 0.8}
              for i in range(6)]

    async def send_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    together = [r.json()["choices"][0]["text"] for r in asyncio.run(send_all())]
    # Six requests, two sampling keys (temperatures), one gathered batch: two generate calls.
    assert (batcher.batches, batcher.calls, batcher.sequences) == (1, 2, 6)
    with TestClient(app) as c:  # one by one: the same completions (per-row seeds)
        alone = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    assert together == alone and batcher.calls == 8


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [1, 99999]}, 400, "out of the vocabulary"),
    ({"prompt": PROMPT, "max_tokens": 600}, 400, "maximum context length is 512"),
    ({"prompt": PROMPT, "stream": True}, 400, "stream"),
    ({"prompt": PROMPT, "model": "no-such-model"}, 404, "does not exist"),
])
def test_bad_requests_get_clear_errors(client, body, status, words):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]


def test_malformed_json_is_400(client):
    r = client.post("/v1/completions", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_api_key(policy):
    with TestClient(create_app(policy, api_key="s3cret")) as c:
        assert c.get("/health").status_code == 200              # probes need no key
        assert c.get("/v1/models").status_code == 401
        r = c.post("/v1/completions", json={"prompt": PROMPT}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A LoRA adapter over preset:tiny (the served base), with non-zero B so it changes the outputs."""
    out = tmp_path_factory.mktemp("adapter")
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(method="lora", r=4), CPU)
    with torch.no_grad():
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    save_pretrained(lm, out / "adapter", base_dir=out / "base")
    return out / "adapter", lm


def test_load_and_unload_adapter(client, adapter_dir):
    path, trained = adapter_dir
    _, base_before = ids_and_logprobs(complete(client, seed=5)["choices"][0])
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert {"id": "ad1", "parent": "tiny"}.items() <= client.get("/v1/models").json()["data"][1].items()
    ids, with_adapter = ids_and_logprobs(complete(client, seed=5, model="ad1")["choices"][0])
    _, base_after = ids_and_logprobs(complete(client, seed=5, model="tiny")["choices"][0])
    assert max(abs(a - b) for a, b in zip(base_after, base_before)) < 1e-5       # the base is untouched
    ref = HFEngine(trained.model, trained.tokenizer, RolloutConfig(max_new_tokens=6)).generate(
        [PROMPT], seeds=[5], logprobs=True)[0]                                    # the trainer's adapter
    assert ids == ref.token_ids and max(abs(a - b) for a, b in zip(with_adapter, ref.logprobs)) < 1e-4
    assert sum(abs(a - b) for a, b in zip(with_adapter, base_before)) / 6 > 0.05
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": str(path)})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "ad1"}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": PROMPT, "model": "ad1"}).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "ad1"}).status_code == 404
    _, base_end = ids_and_logprobs(complete(client, seed=5)["choices"][0])
    assert max(abs(a - b) for a, b in zip(base_end, base_before)) < 1e-5


def test_bad_adapter_path_is_400(client, tmp_path):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]


def test_run_dir_serves_its_final_model_and_a_checkpoint_only_by_its_path(tmp_path):
    """A run still training has no result: serving its dir refuses (exit 2) naming its latest checkpoint,
    which serves by its path (adapter merged); a finished run serves its final/."""
    from safetensors.torch import save_file

    from trainfit.config import to_yaml
    from trainfit.models.state import trainable_state
    from trainfit.train.checkpoint import LATEST

    cfg = tiny_config(tmp_path, "sft", **{"peft.method": "lora", "peft.r": 4})
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    lm = load_policy(cfg.model, cfg.peft, CPU, seed=cfg.train.seed)
    with torch.no_grad():
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    save_file(trainable_state(lm.model, True), str(run / "checkpoints" / "step-000002" / "model.safetensors"))
    (run / "checkpoints" / "step-000002" / "state.json").write_text(json.dumps({"step": 2}))
    (run / "checkpoints" / LATEST).write_text("step-000002")
    with pytest.raises(ConfigError) as e:
        resolve_run_dir(run)
    assert "without a final model" in str(e.value) and str(run / "checkpoints" / "step-000002") in str(e.value)
    assert _invoke_serve(run).exit_code == 2
    assert resolve_run_dir(run / "checkpoints" / "step-000002").checkpoint == run / "checkpoints" / "step-000002"
    served = load_served_policy(str(run / "checkpoints" / "step-000002"), device="cpu")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = lm.model.eval()(input_ids=ids).logits
        assert torch.allclose(served.model(input_ids=ids).logits, want, atol=1e-5)
        assert not hasattr(served.model, "peft_config")  # merged: the trained policy is the base
    save_pretrained(lm, run / "final", base_dir=run / "base")
    assert resolve_run_dir(run).name == str(run / "final")


def test_a_served_checkpoint_is_verified_against_its_manifest(tmp_path):
    """A checkpoint whose file does not match its SHA-256 manifest fails at start (exit 2, naming the file and
    the checkpoint before it); one written before manifests existed serves, with a note saying so."""
    from safetensors.torch import save_file

    from trainfit.config import to_yaml
    from trainfit.models.state import trainable_state
    from trainfit.train.ckpt_manifest import MANIFEST, write_manifest

    cfg = tiny_config(tmp_path, "sft")
    run = tmp_path / "run"
    lm = load_policy(cfg.model, cfg.peft, CPU, seed=cfg.train.seed)
    steps = [run / "checkpoints" / f"step-00000{i}" for i in (1, 2)]
    for i, d in enumerate(steps, 1):
        d.mkdir(parents=True)
        save_file(trainable_state(lm.model, False), str(d / "model.safetensors"))
        (d / "state.json").write_text(json.dumps({"step": i, "manifest": MANIFEST}))
        write_manifest(d, {})
    (run / "config.yaml").write_text(to_yaml(cfg))
    weights = steps[1] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF   # one flipped byte: same size, only the checksum tells
    weights.write_bytes(bytes(data))
    r = _invoke_serve(steps[1])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert (f"checkpoint {steps[1]} is damaged, so it is not served: model.safetensors does not match its SHA-256 "
            f"in {MANIFEST} (corrupted)") in out and f"`trainfit serve {steps[0]}`" in out
    (steps[0] / MANIFEST).unlink()   # as a checkpoint written before manifests: no manifest, none announced
    (steps[0] / "state.json").write_text(json.dumps({"step": 1}))
    served = load_served_policy(str(steps[0]), device="cpu")
    assert served.notes == [f"note: {steps[0]} has no {MANIFEST} (written before checkpoints carried checksums): "
                            "serving it without verifying its files."]


def _invoke_serve(path):
    return CliRunner().invoke(app, ["serve", str(path), "--device", "cpu"])


def test_pipeline_run_dir_serves_only_its_last_stage(tmp_path):
    """A pipeline stopped in its second stage is not served as the first stage's final model."""
    run = tmp_path / "run"
    (run / "0-sft" / "final").mkdir(parents=True)
    (run / "0-sft" / "final" / "config.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump({"stage": "sft", "stages": [{"stage": "sft"}, {"stage": "grpo"}]}))
    with pytest.raises(ConfigError) as e:
        resolve_run_dir(run)
    assert str(run / "0-sft" / "final") in str(e.value)
    (run / "1-grpo" / "final").mkdir(parents=True)
    (run / "1-grpo" / "final" / "config.json").write_text("{}")
    assert resolve_run_dir(run).name == str(run / "1-grpo" / "final")


# lora (the adapter merged into its base) in the default suite; full fine-tuning, the plainer save, slow-only.
@pytest.mark.parametrize("peft", [pytest.param("none", marks=pytest.mark.slow), "lora"])
def test_dpo_run_dir_serves_its_final_policy(tmp_path, peft):
    """A finished stage-dpo run (2 CPU steps, train.device=cpu) serves its final policy: the served
    model's logits are the trained ones (LoRA merged), and a completion request succeeds."""
    from test_dpo import QUIET, dpo_config
    from transformers import AutoModelForCausalLM

    from trainfit.train.run import run_pipeline

    cfg = dpo_config(tmp_path, **{"peft.method": peft, "peft.r": 4})
    r = run_pipeline(cfg, console=QUIET)[0]
    run = Path(cfg.run_dir)
    assert resolve_run_dir(run).name == str(r.final_dir)
    served = load_served_policy(str(run), device="cpu")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        if peft == "none":
            want = AutoModelForCausalLM.from_pretrained(str(r.final_dir)).eval()(input_ids=ids).logits
        else:   # the adapter on its base, merged or not, gives the same logits
            from peft import PeftModel

            base = AutoModelForCausalLM.from_pretrained(str(run / "base")) if (run / "base").exists() else \
                load_policy(cfg.model, PeftConfig(), CPU, seed=cfg.train.seed).model
            want = PeftModel.from_pretrained(base, str(r.final_dir)).eval()(input_ids=ids).logits
        init = load_policy(cfg.model, PeftConfig(), CPU, seed=cfg.train.seed).model.eval()(input_ids=ids).logits
        got = served.model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, init, atol=1e-4)  # trained, not the init
    with TestClient(create_app(served, max_batch=4, batch_wait_ms=5)) as c:
        out = c.post("/v1/completions", json={"prompt": "3+4=", "max_tokens": 4, "temperature": 0})
        assert out.status_code == 200 and out.json()["choices"][0]["text"] is not None, out.text
