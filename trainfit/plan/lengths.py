"""Sequence lengths a run will really train on, measured from its data with its own tokenizer.

The caps (`rollout.max_prompt_length`, `data.max_seq_length`) bound every sequence, but real data is
usually far shorter: the arithmetic task's chat prompts are ~35 SmolLM2 tokens against a 512 cap.
The trainer pads a batch to its longest row, never to the cap:
- GRPO/PPO: prompts are `data.encode_prompt(...)[-max_prompt_length:]` (trainfit/train/grpo.py),
  generated left-padded to the longest prompt of the generation batch, and trained right-padded to
  the longest prompt + completion of the micro-batch (train/logprobs.batch_tensors). Completions
  are planned at `rollout.max_new_tokens` (an eos or a stop string may end them sooner, but nothing
  bounds that before the run), so a sequence is the longest prompt + max_new_tokens.
- SFT: items are `data.encode_example` (a task) or `data.build_sft_items` (data.path rows, read as the
  trainer reads them through trainfit/data/sources/; hub datasets from the local cache only), each
  truncated to max_seq_length, collated right-padded to the longest item of the micro-batch.
- Reward-model pairs (stage rm): the rows preference.PairRows gives the trainer (data.path less its
  held-out split, or pairs made from task.name), encoded by preference.encode_pairs; a micro-batch
  scores its 2 x micro sides padded to the longest, so a sequence is a pair's longer side.
- Images (a vision-language model): JSONL rows and task prompts with images are measured as the
  trainer encodes them, each image's tokens expanded from its size (plan/vision.py
  vlm_item_lengths, task_prompt_lengths); RL prompts with images are never cut (the trainer stops
  with an error instead), so their measured length may exceed max_prompt_length (then capped here).
- Pretraining packs text into blocks of exactly max_seq_length: the cap is the length.
- Multi-turn episodes: environments add observations the planner cannot replay, so the episode is
  planned at its limits (Config.episode_tokens).

Lengths are measured over every row, or a seeded sample of SAMPLE rows of larger sets (its max is
then the planned max, said in the note). Results are cached in process and on disk (cache.py),
keyed by the data (paths with size and mtime, or the generated task's settings), the tokenizer
(files with size and mtime), the chat setting and the caps, so `plan()` in `fit`'s loops stays fast.
The planner downloads nothing: a hub tokenizer is used only when it is already in the local cache;
where the tokenizer or the data cannot be read the plan falls back to the caps, with a note.
"""

from __future__ import annotations

import glob
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from trainfit.config import ConfigError
from trainfit.config.stages import stage_spec
from trainfit.core import cache
from trainfit.data.image_chat import has_images, mark_base_dirs
from trainfit.data.image_examples import example_images
from trainfit.data.sources import kind_of, local_only, read_rows
from trainfit.data.text import build_sft_items, detect_format, encode_example, encode_prompt
from trainfit.models import hub
from trainfit.models.images import is_vlm_config
from trainfit.models.shapes import model_source
from trainfit.models.tokenizer import CHAT_TEMPLATE, TOKENIZER_VOCAB
from trainfit.plan.sample import population_size, sample_indices
from trainfit.plan.vision import task_prompt_lengths, vlm_item_lengths
from trainfit.tasks import build_task
from trainfit.tasks.pairs import PairRows, encode_pairs, encode_unpaired, is_unpaired

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


@dataclass
class Lengths:
    """Tokens per prompt and per training sequence that the plan uses, and where they come from."""

    prompt: int            # RL: longest prompt (after the trainer's truncation); else = seq
    seq: int               # longest training sequence the trainer builds
    cap_prompt: int        # the same at the configured caps
    cap_seq: int
    source: str            # data | caps | packed | episodes
    rows: int = 0          # rows measured
    sampled: bool = False  # a seeded sample of a larger set
    mean: float = 0.0      # mean measured length (prompts for RL, items for SFT)
    note: str = ""
    top: tuple = ()        # the TOP longest measured lengths, longest first (what `mean` is the mean of)

    @property
    def from_data(self) -> bool:
        return self.source == "data"

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """What a plan reports of its lengths (`top` is the planner's own: up to TOP numbers)."""
        return {k: v for k, v in self.to_dict().items() if k != "top"}


TOP = 512   # longest lengths kept from a measurement: packed micro-batches of up to TOP distinct rows


def _per_sequence(cfg, length: int) -> int:
    """Tokens of a training sequence whose measured length (an RL prompt, an item, a pair's longer
    side) is `length`: RL adds the planned completion, rollout.max_new_tokens."""
    if stage_spec(cfg.stage).rollout:
        return min(length + cfg.rollout.max_new_tokens, cfg.episode_tokens())
    return length


def packed_tokens(cfg, lens: Lengths, micro: int, sides: int = 1) -> int:
    """Tokens of the largest padding-free micro-batch (train.padding_free, models/logprobs.ForwardBatch):
    its `micro` samples' real lengths summed, `sides` sequences a sample (2: a pair's chosen and
    rejected, each planned at the pair's longer side), at the worst the data allows: the longest
    measured rows, an RL prompt repeated for its group's grpo.num_generations completions (a group is
    laid out whole). At the caps (nothing measured) every sequence is `lens.seq` tokens: micro x seq."""
    if lens.source != "data" or not lens.top:
        return sides * micro * lens.seq
    group = stage_spec(cfg.stage).group_size(cfg)
    total, left, j = 0, micro, 0
    while left > 0:   # the longest rows first, each up to its group's copies (a small set repeats rows)
        n = min(group, left)
        total += n * _per_sequence(cfg, min(lens.top[j % len(lens.top)], lens.prompt))
        left, j = left - n, j + 1
    return sides * total


def mean_sequence(cfg, lens: Lengths) -> float:
    """Real tokens of an average training sequence (a packed micro-batch's tokens per sequence): the
    measured mean (+ the planned completion for RL); `lens.seq` at the caps."""
    if lens.source != "data" or not lens.mean:
        return float(lens.seq)
    return float(min(_per_sequence(cfg, lens.mean), lens.seq))


def cap_lengths(cfg) -> tuple[int, int]:
    """(prompt tokens, tokens per training sequence) at the configured caps. RL: prompt +
    rollout.max_new_tokens, or the whole multi-turn episode (Config.episode_tokens)."""
    if stage_spec(cfg.stage).rollout:
        return cfg.rollout.max_prompt_length, cfg.episode_tokens()
    return cfg.data.max_seq_length, cfg.data.max_seq_length


def caps(cfg, source: str = "caps", note: str = "") -> Lengths:
    prompt, seq = cap_lengths(cfg)
    return Lengths(prompt, seq, prompt, seq, source, note=note)


_MEMO: dict[str, Lengths] = {}


def missing_locally(path: str) -> bool:
    """A local data path (no glob, no hub id) that does not exist on this machine: data a run generates
    first (cua_tiny's expert rows). The plan is made at the caps; `train` and `--dry-run` refuse it."""
    return not any(c in path for c in "*?[") and not Path(path).expanduser().exists() and kind_of(path) != "hub"


def data_lengths(cfg) -> Lengths:
    """The lengths to plan `cfg` at: measured from its data where known, else the caps (with a note)."""
    spec = stage_spec(cfg.stage)
    rl = spec.rollout
    if spec.data == "text":
        return caps(cfg, "packed")
    if rl and cfg.env.type != "none":
        return caps(cfg, "episodes", "Multi-turn episodes are planned at their limits (rollout.max_episode_tokens, "
                                     "else max_prompt_length + max_turns x (max_new_tokens + env.max_observation_tokens)).")
    rm = spec.reads_pairs   # rm and dpo: the same preference pairs
    # stage rm: data.path first, else the task; sft evaluating episodes (env.type) trains on data.path
    use_task = cfg.data.path is None if rm else bool(cfg.task.name) and not spec.eval_episodes(cfg)
    if not use_task and not (spec.data in ("sft", "pairs") and cfg.data.path):
        return caps(cfg, note="No task or data to measure: planned at the length caps.")
    if not use_task and missing_locally(cfg.data.path):
        return caps(cfg, note=f"data.path={cfg.data.path!r} is not on this machine (yet): planned at the length "
                              "caps; `train` and `--dry-run` need it.")
    base = {"stage": "rl" if rl else "rm" if rm else "sft",   # dpo measures rm's pairs: one cache entry
            "model": [cfg.model.name, cfg.model.revision, cfg.model.gguf_file]
            + ([cfg.model.tokenizer] if cfg.model.tokenizer else [])
            + ([cfg.model.min_pixels, cfg.model.max_pixels] if cfg.model.min_pixels or cfg.model.max_pixels else []),
            "task": cfg.task.model_dump() if use_task else None,
            "data": None if use_task else [cfg.data.path, cfg.data.format, cfg.data.text_field] + _source_keys(cfg.data),
            "limit": cfg.rollout.max_prompt_length if rl else cfg.data.max_seq_length,
            "population": population_size(cfg) if use_task else 0}
    if rm:  # the held-out split and the rejected answers made from a task depend on these
        base["pairs"] = [cfg.data.eval_path, cfg.data.eval_fraction, cfg.train.seed, cfg.task.chat]
    if _is_vlm(cfg):  # rows with images count their image tokens (keys of text models unchanged);
        base["image_tokens"] = 2  # 2: a task's image prompts too (1 measured them as text)
    base["top"] = TOP  # measurements keep their longest lengths (Lengths.top)
    memo_key = cache.stable_hash(base)
    if memo_key in _MEMO:
        return _finish(cfg, _MEMO[memo_key])
    try:
        key = cache.stable_hash({**base, "files": _fingerprint(cfg, use_task)})
        found = cache.read("lengths", key)
        if found is None:
            with local_only():  # hub datasets are read from the local cache only (trainfit/data/sources/)
                found = _measure(cfg, rl, use_task)
            cache.write("lengths", key, found)
    except _Unknown as e:
        found = {"error": str(e)}
    _MEMO[memo_key] = Lengths(**found) if "error" not in found else caps(cfg, note=found["error"])
    return _finish(cfg, _MEMO[memo_key])


def _source_keys(d) -> list:
    """A dataset's subset, split, revision and column mapping (nothing when unset, so the keys of JSONL
    data stay as they were)."""
    keys = {k: getattr(d, k) for k in ("subset", "split", "revision", "columns", "eval_split") if getattr(d, k)}
    return [keys] if keys else []


def _finish(cfg, measured: Lengths) -> Lengths:
    """Measured prompt / item lengths -> the plan's lengths for this config (caps may differ per call)."""
    if measured.source != "data":
        return caps(cfg, measured.source, measured.note)
    cap_prompt, cap_seq = cap_lengths(cfg)
    if stage_spec(cfg.stage).rollout:
        prompt = min(measured.prompt, cap_prompt)
        seq = min(prompt + cfg.rollout.max_new_tokens, cap_seq)
        what = f"prompts of {measured.rows:,} {'sampled ' if measured.sampled else ''}rows: longest {prompt}, " \
               f"mean {measured.mean:.1f} tokens; + max_new_tokens {cfg.rollout.max_new_tokens}"
    else:
        prompt = seq = min(measured.seq, cap_seq)
        kind = "pairs: longest side" if stage_spec(cfg.stage).reads_pairs else "items: longest"
        what = f"{measured.rows:,} {'sampled ' if measured.sampled else ''}{kind} {seq}, mean " \
               f"{measured.mean:.1f} tokens"
    return Lengths(prompt, seq, cap_prompt, cap_seq, "data", measured.rows, measured.sampled, measured.mean,
                   f"Planned from the data ({what}).", tuple(min(n, prompt) for n in measured.top))


def _is_vlm(cfg) -> bool:
    try:
        return is_vlm_config(model_source(cfg.model).config)
    except ConfigError:
        return False


class _Unknown(Exception):
    """The lengths cannot be measured (tokenizer or data unavailable): plan at the caps."""


def _stat(path: str) -> list:
    try:
        st = os.stat(path)
        return [path, st.st_size, st.st_mtime_ns]
    except OSError:
        return [path, None]


def _files(path: str) -> list[str]:
    p = Path(path)
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path, recursive=True))
    if p.is_dir():
        return sorted(str(f) for f in p.rglob("*") if f.is_file())
    return [path]


def _fingerprint(cfg, use_task: bool) -> list:
    """What the measured lengths depend on besides the settings: the tokenizer's and the data's files."""
    name = cfg.model.name
    out: list = []
    if name.startswith("preset:") or cfg.model.tokenizer == "preset":
        out.append(["preset", TOKENIZER_VOCAB, cache.stable_hash(CHAT_TEMPLATE)])
    elif Path(name).is_dir():
        out += [_stat(str(Path(name) / f)) for f in _TOKENIZER_FILES + ("adapter_config.json",)
                + ((cfg.model.gguf_file,) if cfg.model.gguf_file else ())]  # a GGUF's tokenizer is in the file
    elif name.endswith(".gguf"):
        out.append(_stat(name))
    if use_task:
        out += [_stat(p) for p in (cfg.task.path, cfg.task.eval_path) if p]
    else:
        out += [_stat(f) for f in _files(cfg.data.path)]
    return out


def _tokenizer(cfg):
    """The run's tokenizer as the trainer loads it (trainfit.models.policy.load_tokenizer), never downloaded."""
    name = cfg.model.name
    tk = cfg.model.tokenizer  # model.tokenizer: `preset` or a local directory loads without network
    local = name.startswith("preset:") or name.endswith(".gguf") or Path(name).is_dir() or (
        tk is not None and (tk == "preset" or Path(tk).is_dir()))
    if tk is not None and not local:
        name = tk
    files = (cfg.model.gguf_file,) if cfg.model.gguf_file else ("tokenizer_config.json", "tokenizer.json")
    if not local and not any(hub.in_cache(name, cfg.model.revision, f) for f in files):
        # Told from the cache's files, without importing transformers (a repeated plan stays quick).
        raise _Unknown(f"The tokenizer of {name} is not available locally (not in the Hugging Face cache, "
                       f"{hub.cache_dir()}); planned at the length caps (the planner downloads nothing).")
    from trainfit.models.policy import load_tokenizer  # transformers: only on a cold cache

    try:
        if local:
            return load_tokenizer(cfg.model)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, revision=cfg.model.revision, gguf_file=cfg.model.gguf_file,
                                             trust_remote_code=cfg.model.trust_remote_code, local_files_only=True)
    except (ConfigError, OSError, ValueError, ImportError) as e:
        why = str(e).split("\n")[0][:160]
        raise _Unknown(f"The tokenizer of {name} is not available locally ({type(e).__name__}: {why}); planned "
                       "at the length caps (the planner downloads nothing).") from None


def _measure(cfg, rl: bool, use_task: bool) -> dict:
    tok = _tokenizer(cfg)
    try:
        if stage_spec(cfg.stage).reads_pairs:
            lens, sampled = _pair_lengths(cfg, tok)
        elif use_task:
            task = build_task(cfg.task)
            n = task.num_train or population_size(cfg)
            idx, sampled = sample_indices(n)
            examples = [task.train_example(i) for i in idx]

            if any(map(example_images, examples)) and _is_vlm(cfg):
                # Prompts with images (tasks/shapes.py): image tokens expanded as the trainer encodes
                # them (data/image_examples.py); on a text model the trainer reads the placeholder as text.

                lens = task_prompt_lengths(cfg, tok, examples, rl)
            elif rl:
                limit = cfg.rollout.max_prompt_length
                # The trainer's prompt tokens exactly (train/grpo.py `_single_turn`).
                lens = [len(encode_prompt(tok, ex, cfg.task.chat)[-limit:]) for ex in examples]
            else:
                lens = [len(encode_example(tok, ex, cfg.data.max_seq_length, cfg.task.chat)["input_ids"])
                        for ex in examples]
        else:
            rows = read_rows(cfg.data, "sft")  # the trainer's rows, in trainfit's shapes (trainfit/data/sources/)
            idx, sampled = sample_indices(len(rows))
            d = cfg.data  # "auto" is the shape of the file's first record, as the trainer reads it

            records = None if rows.is_dataset else rows.to_list()
            if records is not None and any(map(has_images, records)):  # image tokens counted (data/image_chat.py)

                records = mark_base_dirs(records, cfg.data.path)
                lens = vlm_item_lengths(cfg, tok, [records[i] for i in idx])
            else:
                fmt = detect_format(rows[0], d.text_field) if d.format == "auto" else d.format
                sample = rows.select(idx).to_list() if rows.is_dataset else [records[i] for i in idx]
                items, _ = build_sft_items(sample, tok, d.max_seq_length, fmt, d.text_field, template=d.template)
                lens = [len(it["input_ids"]) for it in items]
    except ConfigError as e:
        raise _Unknown(f"The data could not be measured ({str(e)[:200]}); planned at the length caps.") from None
    if not lens:
        raise _Unknown("The data has no rows to measure; planned at the length caps.")
    longest = max(lens)
    return Lengths(longest, longest, 0, 0, "data", len(lens), sampled, sum(lens) / len(lens),
                   top=tuple(sorted(lens, reverse=True)[:TOP])).to_dict()


def _pair_lengths(cfg, tok) -> tuple[list[int], bool]:
    """Stage rm: the longer side of each training pair (a micro-batch pads its 2 x micro sides to the
    longest, train/rm.py), from the rows the trainer trains on (preference.PairRows), encoded as it
    encodes them (preference.encode_pairs); and whether they are a sample."""
    rows = PairRows(cfg)
    idx, sampled = sample_indices(rows.n)
    picked = rows.train(idx)
    if picked and is_unpaired(picked[0]):   # KTO's unpaired rows (stage dpo): one sequence a sample
        unpaired, _ = encode_unpaired(picked, tok, cfg.data.max_seq_length, cfg.task.chat)
        return [len(r["prompt"]) + len(r["completion"]) for r in unpaired], sampled
    pairs, _ = encode_pairs(picked, tok, cfg.data.max_seq_length, cfg.task.chat)
    return [max(len(p["chosen"]), len(p["rejected"])) for p in pairs], sampled
