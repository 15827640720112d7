"""Many questions over one long document: each question's own full prefill against one shared prefill and
``OffloadCache.fork``.

The document is generated locally, SCBench-style: ``--records`` lines "The special magic number for <word> is
<number>." (sized to ``--context`` tokens), then ``--questions`` questions "What is the special magic number for
<word>?" about records spread over the document. Two ways to answer them, same model, same budget:

* **full**: per question, a new ``OffloadCache`` and ``generate()`` over document + question (the prompt prefilled
  every time);
* **shared**: the document prefilled once into a prefix cache; per question, ``prefix.fork()`` and ``generate()`` over
  the same ids (only the question is new).

Per question: time to first token (the first logits processed, measured inside ``generate()``), the answer and
whether it holds the number. Per way: host bytes of the caches of all questions held at once
(``stats()["host_kv_bytes"]``: summed over the full prefills; the shared pool of the prefix and its forks once). Answers of the
two ways are compared token by token. A real model (``--model qwen05``: ``hf_offload.tools.models.load``) or the tiny
random model of the tests (``--model tiny``: the byte-level tokenizer and tiny Llama of the harness tests, no download; answers are noise,
timings and bytes are real).

    python benchmarks/bench_prefix_sharing.py --model qwen05 --context 4096 --questions 8 --budgets 0 512
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from eval_harness.shared_context import FirstToken  # noqa: E402
from hf_offload import OffloadCache  # noqa: E402

WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lagoon", "meadow", "nectar", "onyx", "prairie", "quartz", "raven", "saffron", "tundra", "umber", "violet",
         "willow", "xenon", "yarrow", "zephyr")  # fmt: skip


def build_document(tokenizer, context: int, questions: int, seed: int) -> tuple[list[int], list[tuple[list[int], str]]]:
    """``(prefix ids, [(question ids, answer)])``: the chat prefix and document of about ``context`` tokens, and
    ``questions`` question suffixes (question, end of turn, assistant header) with their answers."""
    rng = random.Random(seed)
    keys, lines, numbers = set(), [], {}
    while True:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(1000)}"
        if key in keys:
            continue
        keys.add(key)
        numbers[key] = str(rng.randrange(1_000_000, 9_999_999))
        lines.append(f"The special magic number for {key} is {numbers[key]}.")
        if len(lines) % 32 == 0 and len(tokenizer("\n".join(lines)).input_ids) >= context:
            break
    header = "Read the records below and answer the question after them with the number only.\n\n"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        before, after = text.split("\x00")
    else:
        before, after = "", "\n"
    prefix = tokenizer(before + header + "\n".join(lines) + "\n\n", add_special_tokens=False).input_ids
    asked = [lines[i].split(" is ")[0].removeprefix("The special magic number for ")
             for i in sorted(rng.sample(range(len(lines)), questions))]  # fmt: skip
    suffixes = [(tokenizer(f"What is the special magic number for {key}?" + after, add_special_tokens=False).input_ids,
                 numbers[key]) for key in asked]  # fmt: skip
    return prefix, suffixes


def answer(model, tokenizer, ids: list[int], cache: OffloadCache, new_tokens: int) -> dict:
    """Generate greedily over ``ids`` with ``cache``; time to first token, the answer's ids and text."""
    x = torch.tensor([ids])
    first = FirstToken()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), **cache.generate_kwargs(), max_new_tokens=new_tokens,
                             do_sample=False, logits_processor=[first], pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    end = time.perf_counter()
    tokens = out[0, len(ids) :].tolist()
    return {"ttft_s": first.at - start, "total_s": end - start, "tokens": tokens,
            "text": tokenizer.decode(tokens, skip_special_tokens=True)}  # fmt: skip


def run_budget(model, tokenizer, prefix, suffixes, budget: int, new_tokens: int) -> dict:
    settings = {} if budget <= 0 else {"budget_tokens": budget}
    if budget <= 0:
        settings["budget_tokens"] = len(prefix) + max(len(s) for s, _ in suffixes) + new_tokens + 64  # everything
    full, full_caches = [], []
    for ids, number in suffixes:
        cache = OffloadCache(model, **settings)
        row = answer(model, tokenizer, prefix + ids, cache, new_tokens)
        row["correct"] = number in row["text"]
        full.append(row)
        full_caches.append(cache)
    full_host = sum(c.stats()["host_kv_bytes"] for c in full_caches)
    del full_caches
    prefix_cache = OffloadCache(model, **settings)
    x = torch.tensor([prefix])
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=x, attention_mask=torch.ones_like(x), **prefix_cache.forward_kwargs(), use_cache=True,
              logits_to_keep=1)  # fmt: skip
    prefix_s = time.perf_counter() - start
    shared, forks = [], []
    for (ids, number), reference in zip(suffixes, full):
        fork = prefix_cache.fork()
        row = answer(model, tokenizer, prefix + ids, fork, new_tokens)
        row["correct"] = number in row["text"]
        row["same_tokens_as_full"] = row["tokens"] == reference["tokens"]
        shared.append(row)
        forks.append(fork)
    # The forks write their own blocks into the prefix's host pool, whose bytes every cache sharing it reports.
    shared_host = prefix_cache.stats()["host_kv_bytes"]
    assert all(f.stats()["host_kv_bytes"] == shared_host for f in forks)
    return {
        "budget": settings["budget_tokens"], "full_budget": budget <= 0,
        "prefix_tokens": len(prefix), "question_tokens": [len(s) for s, _ in suffixes],
        "full": full, "shared": shared, "prefix_prefill_s": prefix_s,
        "host_bytes_full": full_host, "host_bytes_shared": shared_host,
        "host_bytes_one_request": full_host / len(full),
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random, no download) or a name for tools.models.load")
    parser.add_argument("--context", type=int, default=4096, help="document tokens (about)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 512], help="budget_tokens; 0: the whole context")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/prefix_sharing/bench_prefix_sharing.json")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.model == "tiny":
        from tests.fixtures.tiny import tiny_model, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        model = tiny_model(len(tokenizer), max_positions=args.context + 512, seed=args.seed)
    else:
        from hf_offload.tools.models import load

        model, tokenizer = load(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    prefix, suffixes = build_document(tokenizer, args.context, args.questions, args.seed)
    result = {"metadata": run_metadata(args), "runs": []}
    print(f"document {len(prefix):,} tokens, {len(suffixes)} questions")
    print(f"{'budget':>7s} {'way':7s} {'TTFT q1 s':>9s} {'TTFT q2+ s':>10s} {'ratio':>6s} {'correct':>7s} "
          f"{'same':>5s} {'host MiB':>9s} {'x one':>6s}")  # fmt: skip
    for budget in args.budgets:
        run = run_budget(model, tokenizer, prefix, suffixes, budget, args.new_tokens)
        result["runs"].append(run)
        write_results(args.out, result)
        one = run["host_bytes_one_request"]
        for way in ("full", "shared"):
            rows = run[way]
            first = rows[0]["ttft_s"] if way == "full" else run["prefix_prefill_s"] + rows[0]["ttft_s"]
            later = sum(r["ttft_s"] for r in rows[1:]) / max(1, len(rows) - 1)
            same = "-" if way == "full" else f"{sum(r['same_tokens_as_full'] for r in rows)}/{len(rows)}"
            host = run[f"host_bytes_{way}"]
            print(f"{run['budget']:7d} {way:7s} {first:9.2f} {later:10.3f} {later / first:6.3f} "
                  f"{sum(r['correct'] for r in rows):3d}/{len(rows):<3d} {same:>5s} {host / 2**20:9.1f} "
                  f"{host / one:6.2f}")  # fmt: skip
    result["complete"] = True
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
