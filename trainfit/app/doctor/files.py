"""Reading the files doctor is given and deciding what each one is.

Kinds: `trainfit` (our YAML), `deepspeed` (JSON/HJSON), `accelerate` (YAML), `vllm` (a YAML/JSON of
engine arguments), `commands` (a shell/text file of command lines: torchrun, accelerate launch,
deepspeed, python, `vllm serve`, trainfit), `python` (a training script's source).

Reference batch for learning-rate scaling: a `# base_global_batch_size: N` comment (optionally with
`# base_lr: X`) anywhere in a file records the global batch its learning rate was tuned at. DeepSpeed
reads its JSON with hjson, so such comment lines are valid there too.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from trainfit.config import Config

DS_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
           "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "gradient_clipping", "steps_per_print",
           "zero_allow_untested_optimizer", "wall_clock_breakdown", "activation_checkpointing"}
VLLM_KEYS = {"gpu_memory_utilization", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
             "max_num_seqs", "max_num_batched_tokens", "enforce_eager", "kv_cache_dtype", "served_model_name",
             "swap_space", "enable_prefix_caching", "enable_sleep_mode", "data_parallel_size"}
ACCEL_KEYS = {"distributed_type", "compute_environment"}
# Top-level keys only trainfit has (`model` is shared with vLLM, so it does not decide).
TRAINFIT_KEYS = set(Config.model_fields) - {"model"}
# Launcher options that take no value (so the next token is the script, not their value).
FLAGS = {"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path", "--run_path",
         "--multi_gpu", "--use_deepspeed", "--use_fsdp", "--use_megatron_lm", "--cpu", "--tpu", "--debug",
         "--same_network", "--quiet", "-q", "--no_local_rank", "--force_multi", "--no_ssh", "--no_ssh_check",
         "--save_pid", "--bind_cores_to_rank", "--elastic_training", "--enable_each_rank_log", "--use_env"}
_COMMENT_RE = {"base_global_batch_size": re.compile(r"(?:#|//)\s*base_global_batch_size\s*[:=]\s*(\d+)"),
               "base_lr": re.compile(r"(?:#|//)\s*base_lr\s*[:=]\s*([0-9.]+(?:[eE][-+]?\d+)?)")}


@dataclass
class Command:
    """One command line: launcher (python, torchrun, accelerate, deepspeed, trainfit, vllm), its options,
    the script it runs and the script's arguments (keys without dashes, `-` read as `_`)."""

    launcher: str
    env: dict[str, str]
    opts: dict[str, Any]
    script: Optional[str]
    args: dict[str, Any]
    line: str

    def nodes(self) -> int:
        return _int(self.opts.get("nnodes") or self.opts.get("num_nodes") or self.opts.get("num_machines")) or 1

    def procs_per_node(self) -> Optional[int]:
        """Processes this launch starts per node (None when the launcher uses every visible GPU)."""
        if self.launcher == "python":
            return 1
        if self.launcher == "torchrun":
            v = self.opts.get("nproc_per_node")
            return _int(v) if v not in (None, "gpu", "auto") else None
        if self.launcher == "accelerate":
            total = _int(self.opts.get("num_processes"))
            return total // self.nodes() if total else None
        if self.launcher == "deepspeed":
            return _int(self.opts.get("num_gpus"))
        return None


@dataclass
class Doc:
    path: str
    kind: str
    data: Any = None
    text: str = ""
    error: Optional[str] = None
    commands: list[Command] = field(default_factory=list)
    comments: dict[str, float] = field(default_factory=dict)


def _int(v: Any) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def norm_key(k: str) -> str:
    return k.lstrip("-").replace("-", "_")


def strip_comment_lines(text: str) -> str:
    """JSON as DeepSpeed reads it (hjson): full-line # and // comments and trailing commas allowed.
    Only whole comment lines go, so a `#` inside a JSON string survives."""
    text = "\n".join("" if line.lstrip().startswith(("#", "//")) else line for line in text.splitlines())
    return re.sub(r",(\s*[}\]])", r"\1", text)


def read_comments(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, rx in _COMMENT_RE.items():
        m = rx.search(text)
        if m:
            out[key] = float(m.group(1))
    return out


def parse_args(tokens: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value` and bare `--flag` (True) into a dict; positionals under `_pos`."""
    out: dict[str, Any] = {"_pos": []}
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("-") and len(t) > 1 and not _is_number(t):
            key, eq, val = t.partition("=")
            if eq:
                out[norm_key(key)] = val
            elif i + 1 < len(tokens) and not (tokens[i + 1].startswith("-") and not _is_number(tokens[i + 1])):
                out[norm_key(key)] = tokens[i + 1]
                i += 1
            else:
                out[norm_key(key)] = True
        else:
            out["_pos"].append(t)
        i += 1
    return out


def _is_number(t: str) -> bool:
    try:
        float(t)
        return True
    except ValueError:
        return False


def parse_command(line: str) -> Optional[Command]:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    env: dict[str, str] = {}
    while tokens and (tokens[0] in ("export", "env") or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0])):
        t = tokens.pop(0)
        if "=" in t:
            k, _, v = t.partition("=")
            env[k] = v
    while tokens and tokens[0] in ("exec", "nohup", "time", "srun"):  # wrappers that run the real command
        tokens.pop(0)
    if not tokens:
        return Command("env", env, {}, None, {}, line) if env else None
    prog = Path(tokens[0]).name
    rest = tokens[1:]
    if prog.startswith("python") and rest[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
        prog, rest = "torchrun", rest[2:]
    elif prog.startswith("python") and rest[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        return Command("vllm", env, {}, None, parse_args(rest[2:]), line)
    if prog == "vllm" and rest[:1] == ["serve"]:
        args = parse_args(rest[1:])
        if args["_pos"] and "model" not in args:
            args["model"] = args["_pos"][0]
        return Command("vllm", env, {}, None, args, line)
    if prog == "trainfit":
        return Command("trainfit", env, {}, rest[1] if len(rest) > 1 else None, parse_args(rest[1:]), line)
    if prog == "accelerate" and rest[:1] == ["launch"]:
        prog, rest = "accelerate", rest[1:]
    if prog in ("torchrun", "deepspeed", "accelerate") or prog.startswith("python"):
        launcher = "python" if prog.startswith("python") else prog
        opts, i = {}, 0
        while i < len(rest) and rest[i].startswith("-"):
            key, eq, val = rest[i].partition("=")
            if eq:
                opts[norm_key(key)] = val
            elif launcher == "python" and key == "-m":
                i += 1  # python -m module: the module is the script
                break
            elif key in FLAGS or (launcher == "python" and key in ("-u", "-O", "-B")):
                opts[norm_key(key)] = True
            elif i + 1 < len(rest):
                opts[norm_key(key)] = rest[i + 1]
                i += 1
            i += 1
        script = rest[i] if i < len(rest) else None
        return Command(launcher, env, opts, script, parse_args(rest[i + 1:]), line)
    return None


def command_lines(text: str) -> list[str]:
    """Logical lines of a shell/text file: backslash continuations joined, blank and comment lines dropped."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return out


def _classify_mapping(data: dict, suffix: str) -> str:
    keys = {norm_key(str(k)) for k in data}
    if keys & ACCEL_KEYS:
        return "accelerate"
    if keys & TRAINFIT_KEYS:
        return "trainfit"
    if keys & DS_KEYS:
        return "deepspeed"
    if keys & VLLM_KEYS or isinstance(data.get("model"), str):
        return "vllm"
    return "deepspeed" if suffix == ".json" else "trainfit"


def load_doc(path: str) -> Doc:
    p = Path(path)
    if not p.is_file():
        return Doc(str(path), "missing", error=f"{path} does not exist or is not a file")
    text = p.read_text(errors="replace")
    suffix = p.suffix.lower()
    comments = read_comments(text)
    if suffix == ".py":
        return Doc(str(path), "python", text=text, comments=comments)
    if suffix in (".json", ".yaml", ".yml"):
        try:
            data = json.loads(strip_comment_lines(text)) if suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            kind = "vllm" if "vllm" in p.name.lower() else ("deepspeed" if suffix == ".json" else "trainfit")
            if kind == "trainfit" and re.search(r"^\s*(distributed_type|compute_environment)\s*:", text, re.M):
                kind = "accelerate"
            return Doc(str(path), kind, text=text, comments=comments, error=f"not valid {suffix[1:].upper()}: {e}")
        if data is None:
            data = {}
        if not isinstance(data, dict):
            kind = "deepspeed" if suffix == ".json" else "trainfit"
            return Doc(str(path), kind, data=data, text=text, comments=comments,
                       error=f"holds a {type(data).__name__}, not a mapping of keys")
        kind = _classify_mapping(data, suffix)
        if kind == "vllm":
            data = {norm_key(str(k)): v for k, v in data.items()}
        return Doc(str(path), kind, data=data, text=text, comments=comments)
    cmds = [c for c in (parse_command(line) for line in command_lines(text)) if c is not None]
    return Doc(str(path), "commands", text=text, commands=cmds, comments=comments,
               error=None if cmds else "no command line doctor knows (torchrun, accelerate launch, deepspeed, "
               "python, vllm serve, trainfit) was found")
