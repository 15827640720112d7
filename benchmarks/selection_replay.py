"""Decode replay: RULER accuracy of block selectors on a CPU, from one dense prefill per sample.

Selection recall (``benchmarks/selection_recall.py``) scores each decode query on its own; it does not say whether a
selector's misses change the answer. Decode replay measures the answer itself, without re-running the prefill for
every selector:

1. **Capture** (once per RULER sample, cached on disk): the sample exactly as the runner builds it
   (``eval_harness.ruler.RulerSuite`` with the chat template, as ``recipes/ruler_qwen05.yaml``), one dense greedy
   ``generate()`` with a ``DynamicCache`` in float32 on the CPU through the runner's own ``_generate`` (same
   generation arguments, same stop tokens), and from it: the prompt's keys and values of every layer (after RoPE, as
   the ``DynamicCache`` holds them), the greedy first token (the prefill's last logits), the dense answer and its
   RULER score.
2. **Replay** (per selector): a fresh ``OffloadCache(model, budget_tokens=B, selector=...)`` is filled from the
   captured keys and values by calling each layer's ``update`` as the prompt's one-shot prefill does (then the
   handoff is dropped and ``finish_step`` runs, as after the prefill's attention): blocks are sealed, summarised
   and offloaded exactly as after a real prefill. Then ``generate()`` continues from the prompt plus the captured
   first token, greedily, for the rest of the task's new tokens; the answer is scored with RULER's metric.

A prompt's first forward through an ``OffloadCache`` is exact (dense attention over the prompt), so replay differs
from ``model.generate(prompt, past_key_values=OffloadCache(...))`` only by float rounding between the dense and the
offload prefill attention; ``tests/benchmarks/test_selection_replay.py`` checks that the tokens are identical on a tiny model,
and that replay at a budget covering the context gives the dense tokens. ``--check-full-budget`` repeats the
second check on the real captures.

Selectors are given by registered name; ``union[field=value,...]`` builds a
:class:`~hf_offload.selectors.union.UnionSelector` with other settings (each KV head a quota of its own best blocks,
meanvar's shared vote for the rest).

Example (2-core CPU, Qwen2.5-Coder-0.5B-Instruct: a 4K capture takes 25-50 s, a replay about 2.5 s per sample and
selector in batches of 12)::

    python benchmarks/selection_replay.py --model /tmp/hfo_models/qwen2.5-coder-0.5b-instruct --seed 1 \\
        --samples 12 --out results/selection/replay_4k_seed1.json
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_metadata, write_results  # noqa: E402

TASKS = ["niah_multikey_2", "niah_multikey_3", "niah_multivalue"]
SELECTORS = ["dense", "oracle", "headwise", "solohead", "meanbound", "meanvar"]


def make_selector(name: str):
    """The selector of a name as given on the command line: a registered name, or one with settings in brackets
    (``union[share=0.5]``, ``quantkey[bits=4]``; see :func:`hf_offload.selectors.get_selector`); cache settings
    after ``@`` (:func:`cache_settings`) are not part of it."""
    from hf_offload.selectors import get_selector

    return get_selector(name.split("@", 1)[0])


def cache_settings(name: str) -> dict:
    """``OffloadCache`` settings a method name carries after ``@``, comma-separated ``field=value`` pairs read as
    numbers where they parse (``quantkey[bits=4,tail_bits=2]@max_budget_tokens=1024,missed_mass_target=0.05``:
    the adaptive budget; ``@budget_tokens=1024``: a budget of its own instead of ``--budget``'s); ``{}`` without ``@``.
    Checked by ``OffloadConfig`` like any keyword."""
    if "@" not in name:
        return {}
    settings = {}
    for pair in filter(None, (p.strip() for p in name.split("@", 1)[1].split(","))):
        if "=" not in pair:
            raise ValueError(f"Method {name!r}: write each cache setting after '@' as field=value, got {pair!r}.")
        key, value = (part.strip() for part in pair.split("=", 1))
        for kind in (int, float):
            try:
                settings[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            settings[key] = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    return settings


# ----------------------------------------------------------------------------------------------------------- capture
def capture_dense(model, tokenizer, sample: dict) -> dict:
    """Dense greedy run of one runner sample (``DynamicCache``); returns the prompt's KV, first token and answer.

    Returns:
        ``kv``: one ``[2, kv_heads, prompt_tokens, head_dim]`` tensor per cache layer (CPU, the model dtype);
        ``first_token`` (``None`` when the first greedy token is a stop token: the answer is empty whatever the
        cache); ``dense_ids`` (the new tokens up to the first stop token, as the runner trims them);
        ``dense_s`` (generate wall time).
    """
    from transformers import DynamicCache

    from eval_harness.runner import _generate
    from hf_offload import disable_offload_attention

    disable_offload_attention(model)  # as the runner's dense baseline
    cache = DynamicCache(config=model.config)
    (new_ids,), seconds = _generate(model, tokenizer, [sample], cache, sample["max_new_tokens"], None)
    n = len(sample["input_ids"])
    kv = [torch.stack([layer.keys[0, :, :n], layer.values[0, :, :n]]).cpu().clone() for layer in cache.layers]
    return {"kv": kv, "first_token": new_ids[0] if new_ids else None, "dense_ids": new_ids, "dense_s": seconds}


def capture_path(folder: Path, model_name: str, task: str, length: int, seed: int, index: int, prompt: list) -> Path:
    digest = hashlib.sha1(str(prompt).encode()).hexdigest()[:8]  # a changed sample builder never reuses a capture
    return folder / f"{model_name}-{task}-{length}-s{seed}-{index}-{digest}.pt"


# ------------------------------------------------------------------------------------------------------------ replay
def fill_from_kv(cache, kv: list[torch.Tensor], chunk: int | None = None) -> None:
    """Write captured keys and values into every layer of ``cache`` as a prefill does, ``chunk`` tokens per update.

    ``chunk=None``: one update per layer with the whole prompt, as ``generate()``'s one-shot prefill. After each
    update of an offloaded layer the handoff is dropped (no attention runs) and ``finish_step`` puts the newest
    sealed blocks into the slot pool, as the prefill's attention call does when it ends.

    Args:
        cache: an :class:`~hf_offload.cache.OffloadCache` (or a ``DynamicCache`` built with the model's config).
        kv: one ``[2, kv_heads, tokens, head_dim]`` (batch 1) or ``[2, batch, kv_heads, tokens, head_dim]`` tensor
            per cache layer.
        chunk: tokens per ``update`` call.
    """
    from hf_offload.attention import take_handoff
    from hf_offload.cache import OffloadLayer

    device = getattr(cache, "_model_ref", lambda: None)()
    device = next(device.parameters()).device if device is not None else torch.device("cpu")
    for layer, layer_kv in zip(cache.layers, kv, strict=True):
        n = layer_kv.shape[-2]
        step = chunk or n
        batched = layer_kv if layer_kv.dim() == 5 else layer_kv[:, None]  # [2, batch, kv_heads, tokens, head_dim]
        for start in range(0, n, step):
            k = batched[0, :, :, start : start + step].to(device)
            v = batched[1, :, :, start : start + step].to(device)
            layer.update(k, v)
            if isinstance(layer, OffloadLayer):
                take_handoff()
                layer.finish_step()


def replay(model, tokenizer, sample: dict, cap: dict, selector, budget_tokens: int, fill_chunk=None,
           stats_out: dict | None = None, **offload):  # fmt: skip
    """Greedy answer of ``sample`` with an ``OffloadCache`` filled from ``cap`` (see the module docstring);
    ``stats_out``, if given, receives the cache's ``stats()`` after the decode (its ``missed_mass``: the sample's
    accuracy certificate).

    Returns:
        ``(new_ids, seconds)``: the new tokens up to the first stop token (first token included) and the wall time
        of fill plus decode.
    """
    from eval_harness.runner import _generate
    from hf_offload import OffloadCache

    if cap["first_token"] is None:
        return [], 0.0
    start = time.perf_counter()
    cache = OffloadCache(model, budget_tokens=budget_tokens, selector=selector, **offload)
    fill_from_kv(cache, cap["kv"], fill_chunk)
    cont = dict(sample, input_ids=list(sample["input_ids"]) + [cap["first_token"]])
    (rest,), _ = _generate(model, tokenizer, [cont], cache, sample["max_new_tokens"] - 1, None)
    seconds = time.perf_counter() - start
    if stats_out is not None:
        stats_out.update(cache.stats())
    return [cap["first_token"], *rest], seconds


def replay_batch(model, tokenizer, samples: list[dict], caps: list[dict], selector, budget_tokens: int,
                 fill_chunk=None, **offload) -> tuple[list[list[int]], float]:
    """:func:`replay` of several samples of equal prompt length in one batch (one cache, one ``generate()``).

    Each sequence selects its own blocks, so the answers are those of :func:`replay` up to float rounding of the
    batched matrix products (``--batch`` runs compare both on the first samples). Samples whose first token is a
    stop token get ``[]`` without decoding.

    Returns:
        ``(new_ids per sample, seconds of the batch)``.
    """
    from eval_harness.runner import _generate
    from hf_offload import OffloadCache

    live = [i for i, cap in enumerate(caps) if cap["first_token"] is not None]
    out: list[list[int]] = [[] for _ in caps]
    if not live:
        return out, 0.0
    lengths = {len(samples[i]["input_ids"]) for i in live}
    if len(lengths) != 1:
        raise ValueError(f"replay_batch needs prompts of one length, got {sorted(lengths)}")
    start = time.perf_counter()
    cache = OffloadCache(model, budget_tokens=budget_tokens, selector=selector, **offload)
    kv = [torch.stack([caps[i]["kv"][layer] for i in live], dim=1) for layer in range(len(caps[live[0]]["kv"]))]
    fill_from_kv(cache, kv, fill_chunk)
    conts = [dict(samples[i], input_ids=list(samples[i]["input_ids"]) + [caps[i]["first_token"]]) for i in live]
    rest, _ = _generate(model, tokenizer, conts, cache, samples[live[0]]["max_new_tokens"] - 1, None)
    for i, ids in zip(live, rest):
        out[i] = [caps[i]["first_token"], *ids]
    return out, time.perf_counter() - start


def print_paired(payloads: list[dict]) -> None:
    """Per task, pooled over ``payloads`` (replays of the same methods, e.g. two RULER seeds): each method minus dense
    and minus the first method named, in points, with a 95% paired bootstrap interval and the samples better / worse
    (``eval_harness.report.pair_scores`` and ``paired_bootstrap``; samples pair by file and sample id)."""
    from eval_harness.report import pair_scores, paired_bootstrap

    names = list(payloads[0]["samples"][0]["scores"])
    records = {n: [{"method": n, "task": r["task"], "sample_id": (i, r["sample_id"]), "score": r["scores"][n]}
                   for i, p in enumerate(payloads) for r in p["samples"]] for n in names}  # fmt: skip
    first = next((n for n in names if n != "dense"), None)
    print(f"\npaired, pooled over {len(payloads)} file(s): method minus reference, points [95% interval] better/worse")
    for ref in [n for n in ("dense", first) if n in names]:
        for name in names:
            if name == ref:
                continue
            per_cell, _ = paired_bootstrap(pair_scores(records[ref], records[name], lambda r: (r["task"], r["sample_id"])))
            for task, d in per_cell.items():
                print(f"  {task:18s} {name} minus {ref}: {-d.mean:+.1f} [{-d.high:+.1f}, {-d.low:+.1f}] "
                      f"{d.method_higher}/{d.dense_higher}")


def certificate_summary(rows: list[dict], names: list[str]) -> dict:
    """Per method replayed one sample per cache (``--batch 1``, whose rows carry each sample's ``missed_mass``): how
    its accuracy certificate tracks the points each sample lost to dense (``eval_harness.report.certificate_fit``),
    as a dict of its fields; methods without per-sample certificates are left out."""
    import dataclasses

    from eval_harness.report import certificate_fit

    out = {}
    for name in names:
        pairs = [((r.get("missed_mass") or {}).get(name) or {}, r["scores"]["dense"] - r["scores"][name])
                 for r in rows if name != "dense" and "dense" in r["scores"] and name in r["scores"]]  # fmt: skip
        pairs = [(m["mean"], loss) for m, loss in pairs if m.get("mean") is not None]
        if pairs:
            out[name] = dataclasses.asdict(certificate_fit([m for m, _ in pairs], [loss for _, loss in pairs]))
    return out


def budget_for(sample: dict, share: str, minimum: int) -> int:
    """The runner's budget: ``share`` of prompt plus new tokens, at least ``minimum``."""
    from eval_harness.runner import parse_budget

    return parse_budget(share, minimum).resolve(len(sample["input_ids"]) + sample["max_new_tokens"])


# ------------------------------------------------------------------------------------------------------------ report
def dense_prefix(ids: list[int], dense: list[int]) -> float:
    """Share of the dense answer's tokens that ``ids`` reproduces before its first differing token (1.0: equal)."""
    n = 0
    for a, b in zip(ids, dense):
        if a != b:
            break
        n += 1
    return n / len(dense) if dense else float(ids == dense)


def print_table(payload: dict) -> None:
    """Per task and selector: mean RULER score; then the share of answers equal to dense and the mean share of the
    dense answer reproduced before the first differing token (a finer, lower-variance view of the same replays)."""
    rows = payload["samples"]
    names = list(rows[0]["scores"])
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    s = payload["setting"]
    print(f"\nreplay at {s['length']} tokens, RULER seed {s['seed']}, budget {s['budget']} (min "
          f"{s['budget_min_tokens']}), {len(rows) // len(tasks)} samples per task; RULER score (string_match_all)")
    width = max(len(n) for n in names) + 1
    print(f"{'task':18s}" + "".join(f"{n:>{width}s}" for n in names))

    def line(label, values):
        print(f"{label:18s}" + "".join(f"{v:{width}.1f}" for v in values))

    for t in tasks:
        line(t, [payload["means"][t][n] for n in names])
    line("average", [payload["average"][n] for n in names])
    if "dense" in names:
        print("answer == dense (% of samples)")
        for t in tasks:
            sel = [r for r in rows if r["task"] == t]
            line(t, [100 * sum(r["ids"][n] == r["ids"]["dense"] for r in sel) / len(sel) for n in names])
        print("dense answer reproduced before the first differing token (% of its tokens, mean)")
        for t in tasks:
            sel = [r for r in rows if r["task"] == t]
            line(t, [100 * sum(dense_prefix(r["ids"][n], r["ids"]["dense"]) for r in sel) / len(sel) for n in names])
        line("average", [100 * sum(dense_prefix(r["ids"][n], r["ids"]["dense"]) for r in rows) / len(rows)
                         for n in names])


# -------------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="/tmp/hfo_models/qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1, help="RULER seed (0 is the GPU report's)")
    parser.add_argument("--samples", type=int, default=12, help="samples per task (indices 0..samples-1)")
    parser.add_argument("--selectors", nargs="+", default=SELECTORS,
                        help="dense, registered selectors, union[share=0.5,head_score=quest]; cache settings after "
                        "'@': quantkey[bits=4,tail_bits=2]@max_budget_tokens=1024,missed_mass_target=0.05")
    parser.add_argument("--budget", default="1/16")
    parser.add_argument("--budget-min", type=int, default=512)
    parser.add_argument("--fill-chunk", type=int, default=None, help="tokens per update in the fill (default: all)")
    parser.add_argument("--capture-dir", default="/tmp/hfo_replay_captures")
    parser.add_argument("--capture-only", action="store_true", help="make the captures and stop")
    parser.add_argument("--check-full-budget", type=int, default=0,
                        help="replay this many samples per task at a budget covering the context; must equal dense")
    parser.add_argument("--batch", type=int, default=0,
                        help="samples per batch: 0 all samples of a task in one batch per selector; 1 one at a time")
    parser.add_argument("--check-unbatched", type=int, default=0,
                        help="with batches: also replay this many samples per task one at a time; must be equal")
    parser.add_argument("--out", default=None)
    parser.add_argument("--table", default=None, nargs="+", metavar="JSON",
                        help="print the tables of results files, then their paired differences pooled over the files "
                        "(per task: each method against dense and against the first method), and stop")
    args = parser.parse_args(argv)
    if args.table:
        import json

        payloads = [json.loads(Path(path).read_text()) for path in args.table]
        for payload in payloads:
            print_table(payload)
        print_paired(payloads)
        pooled = certificate_summary([r for p in payloads for r in p["samples"]], list(payloads[0]["samples"][0]["scores"]))
        for n, fit in pooled.items():
            print(f"certificate {n}, pooled: {fit['samples']} samples, Spearman {fit['spearman']:.2f} "
                  f"[{fit['low']:.2f}, {fit['high']:.2f}]")  # fmt: skip
        return payloads[0] if len(payloads) == 1 else payloads

    from eval_harness.ruler import RulerSuite
    from hf_offload.tools.models import load

    torch.set_grad_enabled(False)
    model, tokenizer = load(args.model, dtype=torch.float32, device="cpu")
    model.eval()
    model_name = Path(str(args.model)).name
    suite = RulerSuite(tokenizer, args.samples, seed=args.seed, chat=True)
    folder = Path(args.capture_dir)
    folder.mkdir(parents=True, exist_ok=True)

    # Captures first (the slow part), then replays from disk.
    samples = {}
    capture_s = []
    for task in args.tasks:
        for sample in suite.samples(task, args.length):
            samples[(task, sample["id"])] = sample
    order = sorted(samples.items(), key=lambda kv: (int(kv[0][1].split("-")[1]), args.tasks.index(kv[0][0])))
    for (task, _), sample in order:  # index-major: an interrupted capture run leaves every task as many samples
        path = capture_path(folder, model_name, task, args.length, args.seed, int(sample["id"].split("-")[1]),
                            sample["input_ids"])
        if path.exists():
            continue
        start = time.perf_counter()
        cap = capture_dense(model, tokenizer, sample)
        cap["capture_s"] = time.perf_counter() - start
        cap["prompt_tokens"] = len(sample["input_ids"])
        torch.save(cap, path)
        capture_s.append(cap["capture_s"])
        answer = tokenizer.decode(cap["dense_ids"], skip_special_tokens=True)
        print(f"captured {task} {sample['id']}: {len(sample['input_ids'])} tokens in {cap['capture_s']:.1f} s "
              f"(generate {cap['dense_s']:.1f} s); dense {answer!r} ref {sample['outputs']}", flush=True)
    if args.capture_only:
        return {}

    rows = []
    replay_s: dict[str, list[float]] = {}
    mismatches = []
    unbatched_diff = []
    for task in args.tasks:
        keys = [key for key in samples if key[0] == task]
        task_samples = [samples[key] for key in keys]
        caps = [torch.load(capture_path(folder, model_name, task, args.length, args.seed, int(sid.split("-")[1]),
                                        samples[(task, sid)]["input_ids"])) for _, sid in keys]
        budgets = [budget_for(sample, args.budget, args.budget_min) for sample in task_samples]
        task_rows = [{"task": task, "sample_id": sample["id"], "references": sample["outputs"],
                      "prompt_tokens": len(sample["input_ids"]), "budget_tokens": budget,
                      "capture_s": cap.get("capture_s"), "answers": {}, "scores": {}, "ids": {}}
                     for sample, cap, budget in zip(task_samples, caps, budgets)]
        for name in args.selectors:
            settings = cache_settings(name)
            own = settings.pop("budget_tokens", None)  # a method's own budget (@budget_tokens=N)
            method_budgets = [own] * len(budgets) if own is not None else budgets
            if own is not None:  # the rows' budget_tokens is --budget's; this method's own is recorded beside it
                for row in task_rows:
                    row.setdefault("method_budget_tokens", {})[name] = own
            if name == "dense":
                ids_all = [cap["dense_ids"] for cap in caps]
            elif args.batch == 1:
                ids_all = []
                for row, sample, cap, budget in zip(task_rows, task_samples, caps, method_budgets):
                    stats: dict = {}
                    ids, seconds = replay(model, tokenizer, sample, cap, make_selector(name), budget, args.fill_chunk,
                                          stats_out=stats, **settings)
                    ids_all.append(ids)
                    replay_s.setdefault(name, []).append(seconds)
                    row.setdefault("missed_mass", {})[name] = stats.get("missed_mass")  # this sample's certificate
                    row.setdefault("attended_blocks", {})[name] = stats.get("attended_blocks")  # per step, mean
            else:
                if len(set(method_budgets)) != 1:
                    raise ValueError(f"{task}: budgets differ between samples ({sorted(set(method_budgets))}); use "
                                     "--batch 1")  # fmt: skip
                size = args.batch or len(caps)  # batches of --batch samples (0: all at once)
                ids_all = []
                for at in range(0, len(caps), size):
                    ids, seconds = replay_batch(model, tokenizer, task_samples[at : at + size], caps[at : at + size],
                                                make_selector(name), method_budgets[0], args.fill_chunk,
                                                **settings)
                    ids_all.extend(ids)
                    replay_s.setdefault(name, []).extend([seconds / len(ids)] * len(ids))
                for i in range(min(args.check_unbatched, len(caps))):
                    one, _ = replay(model, tokenizer, task_samples[i], caps[i], make_selector(name),
                                    method_budgets[i], args.fill_chunk, **settings)
                    if one != ids_all[i]:
                        unbatched_diff.append((task, task_samples[i]["id"], name))
            for row, sample, ids in zip(task_rows, task_samples, ids_all):
                answer = tokenizer.decode(ids, skip_special_tokens=True)
                row["answers"][name], row["ids"][name] = answer, ids
                row["scores"][name] = suite.score(task, sample, answer)
            print(f"{task} {name}: mean {sum(r['scores'][name] for r in task_rows) / len(task_rows):.1f}", flush=True)
        n_check = min(args.check_full_budget, len(caps))
        if n_check:
            full = len(task_samples[0]["input_ids"]) + task_samples[0]["max_new_tokens"] + 64
            ids_all, _ = replay_batch(model, tokenizer, task_samples[:n_check], caps[:n_check], "meanbound", full,
                                      args.fill_chunk)
            for row, cap, ids in zip(task_rows, caps, ids_all):
                row["full_budget_equals_dense"] = ids == cap["dense_ids"]
                if ids != cap["dense_ids"]:
                    mismatches.append((task, row["sample_id"]))
        for row in task_rows:
            print(f"{task} {row['sample_id']} budget {row['budget_tokens']}: " + "; ".join(
                f"{n} {row['scores'][n]:.0f} {row['answers'][n][:30]!r}" for n in args.selectors), flush=True)
        rows.extend(task_rows)
        del caps
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    means = {t: {n: sum(r["scores"][n] for r in rows if r["task"] == t) / sum(r["task"] == t for r in rows)
                 for n in args.selectors} for t in tasks}
    average = {n: sum(means[t][n] for t in tasks) / len(tasks) for n in args.selectors}
    agree = {n: sum(r["ids"][n] == r["ids"]["dense"] for r in rows) / len(rows)
             for n in args.selectors if "dense" in args.selectors}
    print(f"\nreplay at {args.length} tokens, RULER seed {args.seed}, budget {args.budget} (min {args.budget_min}), "
          f"{len(rows) // max(len(tasks), 1)} samples per task")
    print(f"{'task':18s} " + " ".join(f"{n[:12]:>12s}" for n in args.selectors))
    for t in tasks:
        print(f"{t:18s} " + " ".join(f"{means[t][n]:12.1f}" for n in args.selectors))
    print(f"{'average':18s} " + " ".join(f"{average[n]:12.1f}" for n in args.selectors))
    if agree:
        print(f"{'= dense tokens':18s} " + " ".join(f"{agree[n]:12.2f}" for n in args.selectors))
    certificate = certificate_summary(rows, args.selectors)
    for n, fit in certificate.items():
        print(f"certificate {n}: {fit['samples']} samples, Spearman {fit['spearman']} [{fit['low']}, {fit['high']}] "
              f"between the missed mass and the points lost to dense")  # fmt: skip
    timing = {"capture_s_per_sample": [r["capture_s"] for r in rows],
              "replay_s_per_sample": {n: sum(v) / len(v) for n, v in replay_s.items()}}
    print("replay s per sample: " + ", ".join(f"{n} {s:.1f}" for n, s in timing["replay_s_per_sample"].items()))
    if args.check_full_budget:
        print(f"full-budget replay equals dense: {not mismatches} (mismatches: {mismatches})")
    if args.check_unbatched:
        print(f"batched replay equals one-at-a-time replay: {not unbatched_diff} (differences: {unbatched_diff})")
    payload = run_metadata(
        args,
        setting={
            "model": model_name, "length": args.length, "seed": args.seed, "budget": args.budget,
            "budget_min_tokens": args.budget_min, "dtype": "float32", "device": "cpu", "chat": True,
            "capture": "dense greedy generate (DynamicCache, eval_harness.runner._generate) per RULER sample: the "
                       "prompt's KV of every layer, the first greedy token and the dense answer",
            "replay": "OffloadCache(model, budget_tokens, selector) filled by each layer's update with the captured "
                      "KV (one-shot prefill), then greedy generate from prompt + first token for the task's "
                      "max_new_tokens - 1; scored with RULER's string_match_all",
            "selectors": {n: repr(make_selector(n)) + (f" with {cache_settings(n)}" if cache_settings(n) else "")
                          for n in args.selectors if n != "dense"},
        },
        timing=timing,
        means=means,
        average=average,
        equals_dense_tokens=agree,
        certificate=certificate,
        full_budget_mismatches=mismatches if args.check_full_budget else None,
        batched_vs_unbatched_differences=unbatched_diff if args.check_unbatched else None,
        samples=rows,
    )
    if args.out:
        write_results(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
