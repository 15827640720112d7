"""Run a suite (RULER, LongBench) over methods x budgets x context lengths, resumable, with raw results in jsonl.

The runner holds no model code: it receives the model, its tokenizer and ``make_cache(method, budget_tokens)``,
which returns the cache for one ``generate()`` call (``None``: the model's default cache). ``"dense"`` runs once per
task and length, without a budget; every other method runs once per budget.

Results go to ``{results_dir}/{study}/{study}-{UTC time}.jsonl``, one file per run: a header line (``"type":
"header"``: machine, versions, git commit, settings, suite metadata) and then one line per sample (``"type":
"result"``: study, suite, task, length, method, budget, budget_tokens, sample_id, prediction, references, score,
time_s, prompt_sha256, estimate_kernel, missed_mass, first_token, ...), flushed as they finish. ``prompt_sha256``
(:func:`prompt_sha256`) identifies the prompt, so that results of two methods pair sample by sample; ``estimate_kernel`` lists the estimates
of the unselected blocks that ran in the sample's ``generate()`` call (``"mma"``, ``"dot"``, ``"loop"``,
``"reference"``; empty where none ran, e.g. dense), and the header's ``estimate_kernel`` those of the file's first
call. ``missed_mass`` is the accuracy certificate of the sample's own sequence (``OffloadCache.stats()``'s
``missed_mass["per_sequence"]``: the estimated share of attention its decode steps left out, ``mean`` and ``max``,
with ``"per_sequence": true``; ``steps`` and ``source`` of the call, and the call's pooled ``mean``, ``max`` and
``last`` under ``call``; ``None`` for dense, or a selector without an estimate), so that a score lost can be set
against the attention that sample missed. Files written before carry the call's values (the batch's where a batch
holds several samples) and no ``per_sequence``; ``cache`` is the batch's. ``first_token`` is the first generated
token (from the prefill's logits, a stop token too), so that an answer that parts from dense's at its first token
(the prefill's exact attention: arithmetic, not selection) can be told apart from one that parts in the decode.
Files written before these fields existed read the same (the report then pairs by sample id).

A later run with the same study skips every (task, length, method, budget, sample id) already in a result line of
any file of the study, so an interrupted run resumes where it stopped.
Failures (e.g. out of memory) are written as ``"type": "error"`` lines and retried by the next run.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from . import files

REPO = Path(__file__).resolve().parent.parent
DENSE = "dense"
_STATS_KEYS = ("device_kv_bytes", "host_kv_bytes", "recalled_bytes", "decode_recalled_bytes", "hit_rate",
               "attended_blocks")  # fmt: skip
_DISK_STATS_KEYS = ("disk_kv_bytes", "disk_read_blocks", "disk_staged_ahead_blocks", "disk_staged_used_blocks")
"""Recorded besides where the cache has a disk tier."""


# ---------------------------------------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    """A decode budget: a share of the context (``"1/16"``, ``0.0625``) with a floor, or a number of tokens.

    Attributes:
        spec: the budget as written (the key in the results).
        fraction: share of the context (prompt + new tokens), or ``None`` for an absolute budget.
        tokens: absolute budget in tokens, or ``None``.
        min_tokens: floor of a fractional budget.
    """

    spec: str
    fraction: Fraction | None
    tokens: int | None
    min_tokens: int = 512

    def resolve(self, context_tokens: int) -> int:
        """Budget in tokens for a context of ``context_tokens`` (prompt plus tokens to generate)."""
        if self.tokens is not None:
            return self.tokens
        return max(self.min_tokens, int(self.fraction * context_tokens))


def parse_budget(spec, min_tokens: int = 512) -> Budget:
    """Read a budget: an integer number of tokens (``2048``, ``"2048"``) or a share (``"1/16"``, ``0.0625``).

    Raises:
        ValueError: anything else, with the accepted forms.
    """
    hint = "write a number of tokens (2048) or a share of the context ('1/16' or 0.0625)"
    if isinstance(spec, bool) or isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"bad budget {spec!r} (min {min_tokens!r}): {hint}; the minimum must be a positive integer")
    text = str(spec).strip()
    try:
        if isinstance(spec, int) or text.isdigit():
            tokens = int(text)
            if tokens < 1:
                raise ValueError
            return Budget(text, None, tokens, min_tokens)
        fraction = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"bad budget {spec!r}: {hint}") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"bad budget {spec!r}: a share must lie in (0, 1]; {hint}")
    return Budget(text, fraction, None, min_tokens)


# ------------------------------------------------------------------------------------------------------- provenance
def git_commit() -> str | None:
    """HEAD of this checkout, or ``$HF_OFFLOAD_GIT_COMMIT`` where the code runs from a copy without git."""
    if os.environ.get("HF_OFFLOAD_GIT_COMMIT"):
        return os.environ["HF_OFFLOAD_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None


def source_sha256() -> str:
    """Hash of ``hf_offload/**/*.py`` and ``eval_harness/**/*.py`` (identifies uncommitted code too)."""
    h = hashlib.sha256()
    for folder in ("hf_offload", "eval_harness"):
        for path in sorted((REPO / folder).rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def provenance(model=None) -> dict:
    """Machine, library versions, git commit, any ``HF_OFFLOAD_*`` variables set (e.g. ``HF_OFFLOAD_MODELS``) and
    (when given) the model's shape, for a results header."""
    import torch
    import transformers

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("hf_offload", "tokenizers", "datasets", "jieba"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            versions[name] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    out = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "gpu": gpu,
            "cuda": torch.version.cuda,
        },
        "versions": versions,
        "git_commit": git_commit(),
        "source_sha256": source_sha256(),
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith("HF_OFFLOAD_") and k != "HF_OFFLOAD_GIT_COMMIT"},  # fmt: skip
    }
    if model is not None:
        cfg = model.config.get_text_config(decoder=True)
        out["model"] = {
            "name_or_path": getattr(model.config, "_name_or_path", None),
            "type": getattr(cfg, "model_type", None),
            "layers": getattr(cfg, "num_hidden_layers", None),
            "kv_heads": getattr(cfg, "num_key_value_heads", None),
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": str(next(model.parameters()).device),
        }
    return out


def prompt_sha256(input_ids) -> str:
    """sha256 (hex) of a prompt's token ids written as decimal numbers joined by commas (``"151644,8948,..."``)."""
    return hashlib.sha256(",".join(str(int(t)) for t in input_ids).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------- storage
def item_key(record: dict) -> tuple:
    """The resume key of a result: ``(task, length, method, budget, sample_id)``."""
    return (record["task"], int(record["length"]), record["method"], record["budget"], str(record["sample_id"]))


def read_lines(results_dir, study: str) -> list[dict]:
    """Every line of every jsonl file of a study, files in name (= time) order, each with its ``_file`` name.

    A file may be stored gzip-compressed (``.jsonl.gz``, :mod:`eval_harness.files`). A line that is not valid JSON
    (a write cut short) is skipped with a warning.
    """
    folder = Path(results_dir) / study
    lines = []
    for path in files.find(folder, "*.jsonl"):
        with files.open_text(path) as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    warnings.warn(f"{path}:{n} is not valid JSON (an interrupted write?); skipped", stacklevel=2)
                    continue
                record["_file"] = path.name
                lines.append(record)
    return lines


def read_study(results_dir, study: str) -> tuple[list[dict], list[dict]]:
    """Header lines and result lines of a study (see :func:`read_lines`)."""
    lines = read_lines(results_dir, study)
    return [x for x in lines if x.get("type") == "header"], [x for x in lines if x.get("type") == "result"]


class ResultWriter:
    """Appends lines to one new jsonl file of a study, writing the header first (the file appears on first use)."""

    def __init__(self, results_dir, study: str, header: dict):
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        self.path = Path(results_dir) / study / f"{study}-{stamp}.jsonl"
        self.header = {"type": "header", **header}
        self._file = None

    @property
    def written(self) -> bool:
        """Whether the file (and so its header) has been written."""
        return self._file is not None or self.path.exists()

    def write(self, record: dict) -> None:
        """Append one line (and flush it)."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
            self._file.write(json.dumps(self.header, ensure_ascii=False, default=str) + "\n")
        self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


# --------------------------------------------------------------------------------------------------------- progress
class _Progress:
    def __init__(self, total: int, enabled: bool, label: str):
        self.total, self.done, self.label, self.bar = total, 0, label, None
        self.enabled = enabled
        if enabled and total:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=label, unit="sample")
            except ImportError:
                print(f"{label}: {total} samples to run", flush=True)

    def update(self, n: int, note: str) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
        elif self.enabled:
            print(f"{self.label}: {self.done}/{self.total} {note}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------------------- generation
def _generate(model, tokenizer, batch: list[dict], cache, max_new_tokens: int, prefill_chunk_size,
              firsts: list | None = None):
    """Greedy generation for a batch of samples (left padding). ``firsts``: a list to extend with each sample's
    first generated token (the prefill's, stop tokens included).

    Returns:
        The new token ids of each sample up to (not including) its first stop token (an EOS of the model's
        generation config, the newline for ``stop_at_newline`` samples, or padding), and the wall time in seconds.
    """
    import torch

    from hf_offload.cache import generate_cache_kwarg

    device = next(model.parameters()).device
    width = max(len(s["input_ids"]) for s in batch)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if pad is None:
        pad = eos[0] if eos else 0
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        n = len(s["input_ids"])
        ids[row, width - n :] = torch.tensor(s["input_ids"], dtype=torch.long)
        mask[row, width - n :] = 1
    kwargs = dict(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        repetition_penalty=1.0,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
    )
    if cache is not None:
        kwargs[generate_cache_kwarg()] = cache  # "cache" on transformers 5.24, "past_key_values" on 5.17
    if prefill_chunk_size:
        kwargs["prefill_chunk_size"] = prefill_chunk_size
    if any(s.get("stop_at_newline") for s in batch):  # LongBench samsum: stop at a newline, generate at least one
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"][-1]
        kwargs["eos_token_id"] = [*eos, newline]
        kwargs["min_new_tokens"] = 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    stop = {*kwargs.get("eos_token_id", eos), pad}
    if firsts is not None:
        firsts.extend(out[:, width].tolist())
    return [_trim(row, stop) for row in out[:, width:].tolist()], seconds


def _trim(tokens: list[int], stop: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i]
    return tokens


def _sample_certificate(missed: dict | None, row: int) -> dict | None:
    """The certificate of the batch's ``row``-th sequence from its call's (:func:`_missed_mass`): its own ``mean``
    and ``max``, the call's ``steps`` and ``source``, the call's pooled values under ``call``; the call's values as
    they are where the cache gave none per sequence."""
    rows = (missed or {}).get("per_sequence")
    if not rows:
        return missed
    return {"mean": rows["mean"][row], "max": rows["max"][row], "steps": missed["steps"], "source": missed["source"],
            "per_sequence": True, "call": {k: missed[k] for k in ("mean", "max", "last")}}  # fmt: skip


def _missed_mass(cache) -> dict | None:
    """The accuracy certificate of a ``generate()`` call: ``cache.stats()["missed_mass"]`` (mean, max and last
    estimated share of attention its decode steps left out, with its source), ``None`` for a cache without one."""
    stats = getattr(cache, "stats", None)
    return stats().get("missed_mass") if callable(stats) else None


def _cache_stats(cache) -> dict | None:
    stats = getattr(cache, "stats", None)
    if not callable(stats):
        return None
    s = stats()
    return {k: s.get(k) for k in _STATS_KEYS + (_DISK_STATS_KEYS if "disk_kv_bytes" in s else ())}


# -------------------------------------------------------------------------------------------------------------- run
@dataclass
class RunSummary:
    """What one run did: results file (``None`` if nothing ran), items run, skipped (already done) and failed."""

    path: Path | None
    ran: int
    skipped: int
    failed: int


def run_study(
    *,
    study: str,
    suite,
    model,
    tokenizer,
    make_cache: Callable[[str, int | None], object],
    tasks,
    lengths: Iterable[int],
    methods: Iterable[str],
    budgets: Iterable = ("1/16",),
    budget_min_tokens: int = 512,
    results_dir="results",
    batch_size: int = 1,
    prefill_chunk_size: int | None = None,
    max_new_tokens: int | None = None,
    settings: dict | None = None,
    progress: bool = True,
    fail_fast: bool = False,
) -> RunSummary:
    """Run every pending (task, length, method, budget, sample) of a study and append the results.

    Args:
        study: study name (results folder ``{results_dir}/{study}``).
        suite: a :class:`~eval_harness.ruler.RulerSuite` or :class:`~eval_harness.longbench.LongBenchSuite` (any
            object with ``name``, ``resolve_tasks``, ``sample_ids``, ``samples``, ``score`` and ``info``).
        model: a transformers causal LM, already on its device, in eval mode.
        tokenizer: its tokenizer.
        make_cache: ``make_cache(method, budget_tokens)`` -> a fresh cache for one ``generate()`` call, or ``None``
            for the model's default; ``budget_tokens`` is ``None`` for ``"dense"``.
        tasks: task names or ``"all"``.
        lengths: context lengths in tokens (RULER: prompt + answer; LongBench: the prompt's token budget).
        methods: ``"dense"`` and/or names ``make_cache`` understands (``"solohead"``, ``"headwise"``, ...).
        budgets: decode budgets of the non-dense methods (see :func:`parse_budget`).
        budget_min_tokens: floor of fractional budgets.
        results_dir: root of the results folders.
        batch_size: samples per ``generate()`` call (left-padded; 1 = one prompt at a time).
        prefill_chunk_size: passed to ``generate()`` when set (chunked prefill).
        max_new_tokens: cap on the tasks' own generation lengths (``None``: the tasks' values; for smoke tests).
        settings: the run's settings (e.g. the recipe), stored in the header.
        progress: show a progress bar (tqdm when installed, else printed lines).
        fail_fast: raise the first error instead of recording it.

    Returns:
        A :class:`RunSummary`.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    methods = list(methods)
    if not methods:
        raise ValueError("no methods given; use e.g. ['dense', 'solohead']")
    parsed = [parse_budget(b, budget_min_tokens) for b in budgets]
    if any(m != DENSE for m in methods) and not parsed:
        raise ValueError("non-dense methods need at least one budget, e.g. budgets: ['1/16']")
    combos = [(m, None) for m in methods if m == DENSE] + [(m, b) for m in methods if m != DENSE for b in parsed]
    task_names = suite.resolve_tasks(tasks)
    lengths = [int(x) for x in lengths]

    _, previous = read_study(results_dir, study)
    done = {item_key(r) for r in previous}
    plan = []  # (task, length, pending combos with their pending sample ids)
    skipped = 0
    for task in task_names:
        for length in lengths:
            ids = suite.sample_ids(task, length)
            pending = []
            for method, budget in combos:
                spec = None if budget is None else budget.spec
                todo = {i for i in ids if (task, length, method, spec, i) not in done}
                skipped += len(ids) - len(todo)
                if todo:
                    pending.append((method, budget, todo))
            if pending:
                plan.append((task, length, pending))
    total = sum(len(todo) for _, _, pending in plan for _, _, todo in pending)
    header = {
        "study": study,
        "suite": suite.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **provenance(model),
        "settings": settings or {},
        "suite_info": suite.info(task_names),
        "generation": {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "batch_size": batch_size,
                       "prefill_chunk_size": prefill_chunk_size, "max_new_tokens_cap": max_new_tokens},
        "budgets": {"methods": methods, "budgets": [b.spec for b in parsed], "budget_min_tokens": budget_min_tokens},
        "estimate_kernel": None,  # set from the first generate() call, before the header is written
    }  # fmt: skip
    from hf_offload.kernels.tail import take_kernels_run
    writer = ResultWriter(results_dir, study, header)
    bar = _Progress(total, progress, study)
    ran = failed = 0
    try:
        for task, length, pending in plan:
            samples = {s["id"]: s for s in suite.samples(task, length)}
            for method, budget, todo in pending:
                chosen = [samples[i] for i in samples if i in todo]
                for start in range(0, len(chosen), batch_size):
                    batch = chosen[start : start + batch_size]
                    n_new = batch[0]["max_new_tokens"]
                    if max_new_tokens is not None:
                        n_new = min(n_new, max_new_tokens)
                    context = max(len(s["input_ids"]) for s in batch) + n_new
                    budget_tokens = None if budget is None else budget.resolve(context)
                    base = {
                        "study": study, "suite": suite.name, "task": task, "length": length, "method": method,
                        "budget": None if budget is None else budget.spec, "budget_tokens": budget_tokens,
                    }  # fmt: skip
                    try:
                        cache = make_cache(method, budget_tokens)
                        take_kernels_run()  # forget what earlier calls ran
                        firsts: list[int] = []
                        new_ids, seconds = _generate(model, tokenizer, batch, cache, n_new, prefill_chunk_size,
                                                     firsts)  # fmt: skip
                        kernels = take_kernels_run()
                        if writer.header["estimate_kernel"] is None and not writer.written:
                            writer.header["estimate_kernel"] = kernels
                        stats = _cache_stats(cache)
                        missed = _missed_mass(cache)
                        del cache
                    except Exception as err:
                        if fail_fast:
                            raise
                        traceback.print_exc()
                        failed += len(batch)
                        for s in batch:
                            error = f"{type(err).__name__}: {err}"
                            writer.write({"type": "error", **base, "sample_id": s["id"], "error": error})
                        _free_memory()
                        bar.update(len(batch), f"{task} {length} {method}: error")
                        continue
                    for row, (s, ids) in enumerate(zip(batch, new_ids)):
                        prediction = tokenizer.decode(ids, skip_special_tokens=True)
                        record = {
                            "type": "result",
                            **base,
                            "sample_id": s["id"],
                            "prediction": prediction,
                            "references": s["outputs"],
                            "score": suite.score(task, s, prediction),
                            "time_s": seconds / len(batch),
                            "batch": len(batch),
                            "prompt_tokens": len(s["input_ids"]),
                            "new_tokens": len(ids),
                            "first_token": firsts[row],
                            "max_new_tokens": n_new,
                            "prompt_sha256": prompt_sha256(s["input_ids"]),
                            "estimate_kernel": kernels,
                            "missed_mass": _sample_certificate(missed, row),
                            "extra": s.get("extra", {}),
                        }
                        if stats is not None:
                            record["cache"] = stats
                        writer.write(record)
                    ran += len(batch)
                    bar.update(len(batch), f"{task} {length} {method} {base['budget'] or ''}".strip())
    finally:
        bar.close()
        writer.close()
    return RunSummary(writer.path if writer.path.exists() else None, ran, skipped, failed)


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
