"""Several questions over one long context: each answer from a shared prefilled prefix against its own full prefill.

A context is a RULER multi-key needle haystack (``niah_multikey_1``'s settings: an essay haystack, word keys, 7-digit
values; ``--questions`` keys, 4 as in RULER) built by :func:`eval_harness.ruler.niah.make_niah_sample`. Each of its
keys is one question: the prompt of question ``q`` is the shared prefix (chat header, instruction, haystack with
every needle) followed by the question's own suffix (the question about key ``q``, the end of the turn, RULER's
answer prefix), token for token the prompt RULER builds when it asks for that key. Per context and budget:

* **full**: per question, a new ``OffloadCache`` and ``generate()`` over prefix + question (the context prefilled
  every time);
* **fork**: the prefix prefilled once into a cache, then per question ``prefix.fork()`` and ``generate()`` over the
  same ids (only the question is prefilled; the fork's time counts in the question's time to first token);
* **dynamic** (at the whole-context budget, the reference without this library): the prefix prefilled once into a
  ``DynamicCache``, then per question ``copy.deepcopy`` of it and ``generate()`` (the copy's time counts).

Budgets: ``full`` (the whole context: token-identical to ``DynamicCache``) and a share (``1/16``) resolved as the
runner does (:class:`eval_harness.runner.Budget`, floor 512 tokens) on the longest prompt plus the new tokens, the same
for both ways. Per question and way: answer tokens and text, RULER's score (``string_match_all``), time to first token
(the first logits processed inside ``generate()``), host bytes and the prompt's sha256; per context the prefix's
prefill time and the host and summary bytes of the forks held together. The summary pairs the two ways question by
question (identical answers; accuracy, full minus fork, with :func:`eval_harness.report.paired_bootstrap`'s 95%
intervals) and each way at the share against the full budget.

    python -m eval_harness.shared_context --model qwen05 --length 4096 --contexts 8 --questions 4 \\
        --budgets full 1/16 --new-tokens 32 --out results/shared_context/qwen05_cpu_4k.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import sys
import time
from pathlib import Path

from .metrics import ruler_postprocess, string_match_all_one
from .report import pair_scores, paired_bootstrap
from .ruler.niah import NEEDLE, NiahConfig, _templates, make_niah_sample
from .ruler.prompt import answer_prefix_text, chat_frame, encode
from .runner import parse_budget, prompt_sha256, provenance

FULL = "full"
_NEEDLE = re.compile("^" + re.escape(NEEDLE).replace(r"\{kind\}", r"\w+").replace(r"\{key\}", "(.+)").replace(
    r"\{value\}", "(.+)") + "$")  # fmt: skip


def make_context(tokenizer, length: int, questions: int, index: int, seed: int = 0, chat: bool = True) -> dict:
    """One context and its questions, in the model's tokens.

    Args:
        tokenizer: the model's tokenizer.
        length: RULER context length: the longest prompt has ``length - 128`` tokens (RULER's NIAH new tokens).
        questions: needles (keys) in the haystack, each asked by one question.
        index: the context's number; with ``seed`` it seeds the haystack, keys, values and depths.
        seed: the study's seed.
        chat: wrap the prompt in the tokenizer's chat template.

    Returns:
        ``prefix`` (token ids shared by every question), ``questions``: per key ``{"key", "suffix", "outputs"}``
        (``prefix + suffix`` is the prompt RULER builds when it asks for that key), ``needle_positions``.
    """
    cfg = NiahConfig("essay", "words", "numbers", num_keys=questions)
    sample = make_niah_sample(tokenizer, cfg, length - 128, random.Random(f"shared:{seed}:{index}"), chat)
    frame = chat_frame(tokenizer, chat)
    values = {}
    for needle in sample["needles"]:
        key, value = _NEEDLE.match(needle).groups()
        values[key] = value

    def suffix(key: str) -> list[int]:
        _, after, answer = _templates(cfg.value_type, key, True)
        return [*encode(tokenizer, after), *frame.tail, *encode(tokenizer, answer_prefix_text(answer, frame))]

    asked = suffix(sample["query"])
    prefix = sample["input_ids"][: len(sample["input_ids"]) - len(asked)]
    if prefix + asked != sample["input_ids"]:
        raise AssertionError("the question's suffix does not rebuild RULER's prompt")
    return {
        "prefix": prefix,
        "questions": [{"key": k, "suffix": suffix(k), "outputs": [v]} for k, v in values.items()],
        "needle_positions": sample["needle_positions"],
    }


class FirstToken:
    """A logits processor that records when ``generate()`` first processes logits (the end of the prefill)."""

    def __init__(self):
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            if scores.is_cuda:
                import torch

                torch.cuda.synchronize(scores.device)  # the prefill's kernels may still run
            self.at = time.perf_counter()
        return scores


def answer(model, tokenizer, ids: list[int], cache, new_tokens: int) -> dict:
    """Greedy ``generate()`` over ``ids`` with ``cache``: answer ids (up to the first EOS), text, time to first
    token and total seconds."""
    import torch

    x = torch.tensor([ids], device=next(model.parameters()).device)
    first = FirstToken()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    start = time.perf_counter()
    with torch.inference_mode():
        kwargs = cache.generate_kwargs() if hasattr(cache, "generate_kwargs") else {"past_key_values": cache}
        out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs, max_new_tokens=new_tokens, do_sample=False,
                             logits_processor=[first], pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    total = time.perf_counter() - start
    tokens = out[0, len(ids) :].tolist()
    for i, t in enumerate(tokens):
        if t in eos:
            tokens = tokens[:i]
            break
    return {"tokens": tokens, "prediction": tokenizer.decode(tokens, skip_special_tokens=True),
            "ttft_s": first.at - start, "total_s": total}  # fmt: skip


def _stats(cache) -> dict:
    s = cache.stats()
    keys = ("host_kv_bytes", "host_shared_bytes", "device_summary_bytes", "device_summary_shared_bytes")
    return {k: s.get(k) for k in keys}


def run_context(model, tokenizer, context: dict, index: int, length: int, budget_spec: str, new_tokens: int,
                admission: str | None = None, reuse_fork: bool = False) -> dict:
    """Both ways over one context at one budget: the records (one per question and way) and the context's row.
    ``admission``: the caches' ``admission`` (``None``: the library's default; ``"always"`` keeps every sealed
    block in host memory, so that host bytes are all the KV). ``reuse_fork``: one fork serves the questions in
    turn, refilled for each (``prefix.fork(into=fork)``: its CUDA graphs replay), instead of a new fork per
    question, all held to the end."""
    from hf_offload import OffloadCache

    settings = {} if admission is None else {"admission": admission}
    prefix, questions = context["prefix"], context["questions"]
    longest = len(prefix) + max(len(q["suffix"]) for q in questions) + new_tokens
    if budget_spec == FULL:
        budget = longest + 64  # every token: token-identical to DynamicCache
    else:
        budget = parse_budget(budget_spec).resolve(longest)
    records = []
    for q, question in enumerate(questions):
        ids = prefix + question["suffix"]
        cache = OffloadCache(model, budget_tokens=budget, **settings)
        row = answer(model, tokenizer, ids, cache, new_tokens)
        records.append(_record(row, "full", index, q, length, budget_spec, budget, ids, question, _stats(cache)))
        del cache  # the full prefills share nothing, so their bytes add up; one at a time is enough (a cache let
        # go of parks its CUDA graphs for the next one)
    full_host = sum(r["host_kv_bytes"] for r in records)
    full_summary = sum(r["device_summary_bytes"] for r in records)

    import torch

    prefix_cache = OffloadCache(model, budget_tokens=budget, **settings)
    x = torch.tensor([prefix], device=next(model.parameters()).device)
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=x, attention_mask=torch.ones_like(x), **prefix_cache.forward_kwargs(), use_cache=True,
              logits_to_keep=1)  # fmt: skip
    prefix_s = _synced(x) - start
    prefix_summary = prefix_cache.stats()["device_summary_bytes"]
    forks, fork = [], None
    for q, question in enumerate(questions):
        ids = prefix + question["suffix"]
        start = time.perf_counter()
        fork = prefix_cache.fork(into=fork if reuse_fork else None)
        fork_s = _synced(x) - start
        row = answer(model, tokenizer, ids, fork, new_tokens)
        row["ttft_s"] += fork_s  # a question waits for its fork
        row["total_s"] += fork_s
        record = _record(row, "fork", index, q, length, budget_spec, budget, ids, question, _stats(fork))
        record["fork_s"] = fork_s
        record["same_tokens_as_full"] = row["tokens"] == records[q]["tokens"]
        record["reused_fork"] = reuse_fork and q > 0
        records.append(record)
        if not reuse_fork:
            forks.append(fork)
    forks = forks or [fork]
    fork_stats = [f.stats() for f in forks]
    forked = [r for r in records if r["method"] == "fork"]
    first_s = prefix_s + forked[0]["ttft_s"]  # the first question waits for the prefix's prefill
    later_s = sum(r["ttft_s"] for r in forked[1:]) / len(forked[1:]) if len(forked) > 1 else None
    one_request = full_host / len(questions)
    host_fork = prefix_cache.stats()["host_kv_bytes"]
    held = {
        "context": index, "budget": budget_spec, "budget_tokens": budget, "prefix_tokens": len(prefix),
        "question_tokens": [len(q["suffix"]) for q in questions], "prefix_prefill_s": prefix_s,
        "forks_held": len(forks),  # at the end: every question's, or the one refilled for each
        # the forks write their own blocks into the prefix's host pool: every cache sharing it reports it whole
        "host_bytes_full": full_host, "host_bytes_fork": host_fork, "host_bytes_one_request": one_request,
        "host_bytes_fork_over_one": host_fork / one_request if one_request else None,
        # time to first token of the forks' first question (prefix prefill included) and of the later ones
        "ttft_first_question_s": first_s, "ttft_later_questions_s": later_s,
        "ttft_later_over_first": None if later_s is None else later_s / first_s,
        "device_summary_bytes_full": full_summary, "device_summary_bytes_prefix": prefix_summary,
        "device_summary_bytes_forks": sum(s["device_summary_bytes"] for s in fork_stats),
        "device_summary_shared_bytes_forks": sum(s.get("device_summary_shared_bytes", 0) for s in fork_stats),
    }  # fmt: skip
    del forks, fork, prefix_cache  # the reference below gets the device memory they held
    gc.collect()
    if budget_spec == FULL:
        dynamic = dynamic_prefix(model, tokenizer, prefix, questions, new_tokens)
        for q, (question, row) in enumerate(zip(questions, dynamic["rows"])):
            ids = prefix + question["suffix"]
            record = _record(row, "dynamic", index, q, length, budget_spec, None, ids, question, {})
            record["same_tokens_as_full"] = row["tokens"] == records[q]["tokens"]
            records.append(record)
        later = dynamic["later_s"]
        held.update(prefix_prefill_dynamic_s=dynamic["prefix_s"], ttft_first_question_dynamic_s=dynamic["first_s"],
                    ttft_later_questions_dynamic_s=later,
                    ttft_later_over_first_dynamic=None if later is None else later / dynamic["first_s"])  # fmt: skip
    return {"records": records, "context": held}


def _synced(x) -> float:
    """``time.perf_counter()`` once the device of ``x`` has finished its queued work."""
    if x.is_cuda:
        import torch

        torch.cuda.synchronize(x.device)
    return time.perf_counter()


def dynamic_prefix(model, tokenizer, prefix: list[int], questions: list[dict], new_tokens: int) -> dict:
    """The reference without this library: the prefix prefilled once into a ``DynamicCache``, then per question
    ``copy.deepcopy`` of it (transformers' way to reuse a prompt's cache) and ``generate()`` over prefix + question.
    Returns the rows of :func:`answer` (time to first token and total include the copy), the prefix's prefill
    time, the first question's time to first token (the prefix's prefill included) and the later ones' mean."""
    import copy

    import torch
    from transformers import DynamicCache

    x = torch.tensor([prefix], device=next(model.parameters()).device)
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=x, attention_mask=torch.ones_like(x), past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefix_s = _synced(x) - start
    rows = []
    for question in questions:
        start = time.perf_counter()
        own = copy.deepcopy(cache)
        copy_s = _synced(x) - start
        row = answer(model, tokenizer, prefix + question["suffix"], own, new_tokens)
        row["ttft_s"] += copy_s
        row["total_s"] += copy_s
        rows.append(row)
        del own
    later = sum(r["ttft_s"] for r in rows[1:]) / len(rows[1:]) if len(rows) > 1 else None
    return {"rows": rows, "prefix_s": prefix_s, "first_s": prefix_s + rows[0]["ttft_s"], "later_s": later}


def _record(row, way, index, q, length, budget_spec, budget, ids, question, stats) -> dict:
    prediction = ruler_postprocess(row["prediction"])
    return {
        "task": "shared_niah_multikey", "length": length, "method": way, "budget": budget_spec,
        "budget_tokens": budget, "sample_id": f"{index}-{q}", "context": index, "question": q, "key": question["key"],
        "prompt_tokens": len(ids), "prompt_sha256": prompt_sha256(ids), "references": question["outputs"],
        "prediction": row["prediction"], "tokens": row["tokens"],
        "score": 100.0 * string_match_all_one(prediction, question["outputs"]),
        "ttft_s": row["ttft_s"], "total_s": row["total_s"], **stats,
    }  # fmt: skip


def summarize(records: list[dict], budgets: list[str], contexts: list[dict] | None = None) -> dict:
    """Per budget: identical answers, accuracy of each way, full minus fork with its 95% paired bootstrap interval,
    mean time to first token; per way: the full budget minus each other budget (the cost of the sparse budget).
    With the contexts' rows (:func:`run_context`): the largest over contexts of the forks' later questions' mean
    time to first token over the first question's (prefix prefill included), and of the host bytes of the prefix
    and its forks over those of one request prefilled alone."""

    def key(r):
        return (r["task"], r["length"]), r["sample_id"]

    def diff(a, b):
        _, average = paired_bootstrap(pair_scores(a, b, key))
        d = average([(a[0]["task"], a[0]["length"])]) if a and b else None
        return None if d is None else d.__dict__

    out = {}
    for budget in budgets:
        full = [r for r in records if r["budget"] == budget and r["method"] == "full"]
        fork = [r for r in records if r["budget"] == budget and r["method"] == "fork"]
        if not fork:
            continue
        out[budget] = {
            "questions": len(fork), "identical": sum(r["same_tokens_as_full"] for r in fork),
            "accuracy_full": sum(r["score"] for r in full) / len(full),
            "accuracy_fork": sum(r["score"] for r in fork) / len(fork),
            "full_minus_fork": diff(full, fork),
            "ttft_s_full": sum(r["ttft_s"] for r in full) / len(full),
            "ttft_s_fork": sum(r["ttft_s"] for r in fork) / len(fork),
            # a question's whole answer (prefill, decode, the fork or copy): what sharing the prefix saves in all
            "total_s_full": sum(r["total_s"] for r in full) / len(full),
            "total_s_fork": sum(r["total_s"] for r in fork) / len(fork),
        }  # fmt: skip
        dynamic = [r for r in records if r["budget"] == budget and r["method"] == "dynamic"]
        if dynamic:  # the reference without the library (the whole-context budget only)
            out[budget].update(identical_dynamic=sum(r["same_tokens_as_full"] for r in dynamic),
                               accuracy_dynamic=sum(r["score"] for r in dynamic) / len(dynamic),
                               ttft_s_dynamic=sum(r["ttft_s"] for r in dynamic) / len(dynamic),
                               total_s_dynamic=sum(r["total_s"] for r in dynamic) / len(dynamic))  # fmt: skip
        rows = [c for c in contexts or () if c["budget"] == budget]
        for name in ("ttft_later_over_first", "ttft_later_over_first_dynamic", "host_bytes_fork_over_one"):
            values = [c[name] for c in rows if c.get(name) is not None]
            if values:
                out[budget][f"max_{name}"] = max(values)
    if FULL in out:
        for budget, row in out.items():
            if budget == FULL:
                continue
            for way in ("full", "fork"):
                dense = [r for r in records if r["budget"] == FULL and r["method"] == way]
                sparse = [r for r in records if r["budget"] == budget and r["method"] == way]
                done = {r["sample_id"] for r in sparse}
                row[f"{way}_at_full_budget_minus_{way}"] = diff([r for r in dense if r["sample_id"] in done],
                                                                       sparse)  # fmt: skip
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen05", help="a registry name or folder (hf_offload.tools.models.load)")
    parser.add_argument("--length", type=int, default=4096, help="RULER context length in tokens")
    parser.add_argument("--contexts", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4, help="keys per context, one question each")
    parser.add_argument("--budgets", nargs="+", default=[FULL, "1/16"], help="'full' or a budget (tokens or share)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--admission", choices=["always", "auto"], default=None,
                        help="the caches' admission (default: the library's); 'always' keeps every sealed block in "
                             "host memory, so that host bytes are all the KV")  # fmt: skip
    parser.add_argument("--reuse-fork", action="store_true",
                        help="one fork serves the questions in turn, refilled for each (prefix.fork(into=fork)), "
                             "instead of a new fork per question, all held to the end")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/shared_context/shared_context.json")
    args = parser.parse_args(argv)

    import torch

    from hf_offload.tools.models import load

    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    result = {"metadata": {**provenance(model), "args": vars(args), "command": " ".join(sys.argv)},
              "contexts": [], "records": []}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for index in range(args.contexts):
        context = make_context(tokenizer, args.length, args.questions, index, args.seed)
        for budget in args.budgets:
            run = run_context(model, tokenizer, context, index, args.length, budget, args.new_tokens,
                              args.admission, args.reuse_fork)  # fmt: skip
            result["records"] += run["records"]
            result["contexts"].append(run["context"])
            result["summary"] = summarize(result["records"], args.budgets, result["contexts"])
            out.write_text(json.dumps(result, indent=1))
            fork = [r for r in run["records"] if r["method"] == "fork"]
            same = sum(r["same_tokens_as_full"] for r in fork)
            full = [r for r in run["records"] if r["method"] == "full"]
            print(f"context {index} budget {budget:>5s} ({run['context']['budget_tokens']} tokens): identical "
                  f"{same}/{len(fork)}, score full {sum(r['score'] for r in full) / len(full):.0f} fork "
                  f"{sum(r['score'] for r in fork) / len(fork):.0f}, TTFT full "
                  f"{sum(r['ttft_s'] for r in full) / len(full):.2f}s fork "
                  f"{sum(r['ttft_s'] for r in fork) / len(fork):.2f}s; later / first question "
                  f"{run['context']['ttft_later_over_first'] or 0:.3f}, host bytes fork / one request "
                  f"{run['context']['host_bytes_fork_over_one'] or 0:.2f}", flush=True)  # fmt: skip
            if run["context"].get("ttft_later_questions_dynamic_s") is not None:
                c = run["context"]
                print(f"  DynamicCache prefix, deep-copied per question: TTFT first "
                      f"{c['ttft_first_question_dynamic_s']:.2f}s "
                      f"later {c['ttft_later_questions_dynamic_s']:.3f}s ({c['ttft_later_over_first_dynamic']:.3f}); "
                      f"fork later {c['ttft_later_questions_s']:.3f}s", flush=True)  # fmt: skip
    result["complete"] = True
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
