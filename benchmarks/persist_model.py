"""Save a real model's cache, load it in a new process and continue: token- and logit-identical to the uninterrupted
cache, at the whole-context budget and at sparse budgets.

Per budget: ``batch`` prompts of real text (documents of key-value records, as ``bench_memory_cap --model``) are
prefilled and ``--first`` tokens generated; the cache is saved; the same cache then generates ``--more`` tokens (the
uninterrupted run). A new process loads the model and the file and generates the same ``--more`` tokens. Compared:
the tokens, the selection counters, the largest difference of any logit (a loaded cache may attend the same blocks in
another order: its blocks start on the host, the uninterrupted cache's partly on the device), and how each
continuation ran (decode steps replayed from CUDA graphs, captures). The blocks every step selected are compared where
the planner runs in Python at every step: with ``--cuda-graphs off``, or on the CPU. A replayed graph plans inside
the graph, so with graphs the two runs plan different numbers of steps in Python and their selections are reported as
not compared.

    python benchmarks/persist_model.py --model qwen05 --context 16384 --batch 2 --budgets 0 1024 \
        --dir /tmp --out results/persist/qwen05_model_16k.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import run_metadata, write_results
from hf_offload import OffloadCache
from hf_offload.cache.container import generate_cache_kwarg
from hf_offload.cache.planner import DecodePlanner

COUNTERS = ("decode_steps", "reused_selections")
GRAPH_COUNTERS = ("graph_replays", "layer_graph_replays", "graph_captures", "layer_graph_captures",
                  "graph_capture_retries")  # fmt: skip


def continue_recorded(model, cache, ids: torch.Tensor, mask: torch.Tensor, more: int) -> dict:
    """Generate ``more`` tokens greedily after ``ids`` with ``cache`` (which holds all of ``ids`` but the last
    token); the new tokens, each step's logits, the blocks each planned step chose (where the planner runs in
    Python: with CUDA graphs a replayed step plans inside its graph) and the selection counters."""
    selections = []
    plan = DecodePlanner.plan

    def recording(self, *args, **kwargs):
        selection = plan(self, *args, **kwargs)
        if selection.blocks.is_cuda and torch.cuda.is_current_stream_capturing():
            return selection  # a graph being captured: its values are not this step's (and a read would break it)
        selections.append(selection.blocks.masked_fill(~selection.keep, -1).sort(dim=-1).values.tolist())
        return selection

    cache.reset_stats()
    DecodePlanner.plan = recording
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=more, min_new_tokens=more,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 **{generate_cache_kwarg(): cache})  # fmt: skip
    finally:
        DecodePlanner.plan = plan
    stats = cache.stats()
    return {
        "tokens": out.sequences[:, ids.shape[1] :].tolist(),
        "logits": torch.stack(out.logits).float().cpu(),
        "selections": hashlib.sha256(json.dumps(selections).encode()).hexdigest(),
        "planned_selections": len(selections),
        "counters": {key: stats.get(key) for key in COUNTERS},
        "graphs": {key: stats.get(key) for key in GRAPH_COUNTERS},
    }


def _load_model(name: str, device: str, context: int = 0):
    """A registry model, a folder, or ``tiny``: the tests' random tiny Llama and byte-level tokenizer (no download;
    its answers are noise, its cache is real)."""
    if name == "tiny":
        from tests.fixtures.tiny import tiny_model, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return tiny_model(len(tokenizer), max_positions=max(context, 4096) + 512, seed=0).to(device), tokenizer
    from hf_offload.tools.models import load

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return load(name, dtype=dtype, device=device)


def graph_option(choice: str) -> dict:
    """The cache setting of ``--cuda-graphs``: ``auto`` leaves the cache's default; ``on`` raises where a capture
    fails (instead of running that layer op by op)."""
    return {"auto": {}, "on": {"cuda_graphs": True}, "off": {"cuda_graphs": False}}[choice]


def _continue_job(path: str) -> None:
    """The new process: load the model, then each saved cache, and continue it."""
    job = json.loads(Path(path).read_text())
    model, _ = _load_model(job["model"], job["device"], job["context"])
    results = {}
    for name, run in job["runs"].items():
        start = time.perf_counter()
        cache = OffloadCache.load(run["file"], model, **graph_option(job["cuda_graphs"]))
        load_s = time.perf_counter() - start
        ids = torch.tensor(run["ids"], device=model.device)
        mask = torch.tensor(run["mask"], device=model.device)
        results[name] = dict(continue_recorded(model, cache, ids, mask, job["more"]), load_s=load_s)
        torch.save(results[name].pop("logits"), run["file"] + ".logits")
        cache.close()
    print("RESULT " + json.dumps(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen05",
                        help="a registry name or folder for hf_offload.tools.models.load, or 'tiny' (random, "
                        "no download)")
    parser.add_argument("--context", type=int, default=16384, help="prompt tokens per sequence")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 1024],
                        help="budget_tokens (0: the whole context)")
    parser.add_argument("--first", type=int, default=8, help="tokens generated before the save")
    parser.add_argument("--more", type=int, default=24, help="tokens generated after it")
    parser.add_argument("--dir", default="/tmp", help="where the cache files are written (removed after)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                        help="off: every decode step runs op by op, so every step's selection is compared; on: a "
                             "failed capture raises")
    parser.add_argument("--out", default=None)
    parser.add_argument("--continue-job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.continue_job:
        _continue_job(args.continue_job)
        return 0

    from benchmarks.bench_memory_cap import real_prompts

    model, tokenizer = _load_model(args.model, args.device, args.context)
    prompts = real_prompts(tokenizer, args.batch, args.context).to(model.device)
    work = Path(args.dir) / f"persist_model_{os.getpid()}"
    work.mkdir(mode=0o700)
    runs, expected = {}, {}
    try:
        for budget in args.budgets:
            name = "full" if budget == 0 else f"budget_{budget}"
            cache = OffloadCache(model, budget_tokens=budget or args.context + args.first + args.more + 256,
                                 **graph_option(args.cuda_graphs))  # fmt: skip
            mask = torch.ones_like(prompts)
            with torch.no_grad():
                out = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=args.first,
                                     min_new_tokens=args.first, do_sample=False,
                                     **{generate_cache_kwarg(): cache})  # fmt: skip
            ids = out
            mask = torch.ones_like(ids)
            file = work / f"{name}.safetensors"
            start = time.perf_counter()
            cache.save(file)
            save_s = time.perf_counter() - start
            expected[name] = dict(continue_recorded(model, cache, ids, mask, args.more), save_s=save_s,
                                  file_bytes=file.stat().st_size)  # fmt: skip
            cache.close()
            runs[name] = {"file": str(file), "ids": ids.tolist(), "mask": mask.tolist()}
            print(f"{name}: saved {file.stat().st_size / 2**20:,.0f} MiB in {save_s:.2f} s", flush=True)
        job = work / "job.json"
        job.write_text(json.dumps({"model": args.model, "device": args.device, "context": args.context,
                                    "more": args.more, "cuda_graphs": args.cuda_graphs,
                                    "runs": runs}))
        done = subprocess.run([sys.executable, __file__, "--continue-job", str(job)], capture_output=True, text=True,
                              check=False,
                              cwd=ROOT, timeout=1800)  # fmt: skip
        if done.returncode != 0:
            err = done.stderr if len(done.stderr) <= 8000 else f"{done.stderr[:4000]}\n...\n{done.stderr[-4000:]}"
            raise SystemExit(f"the new process failed:\n{err}")  # the first error of a chain, and the last
        got = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
        for name, run in runs.items():
            got[name]["logits"] = torch.load(run["file"] + ".logits")
    finally:
        for path in work.iterdir():
            path.unlink()
        work.rmdir()

    rows = []
    for name in runs:
        a, b = expected[name], got[name]
        row = {
            "budget": name,
            "tokens_identical": a["tokens"] == b["tokens"],
            # Compared only where both runs planned every step in Python (a replayed graph plans inside the graph).
            "selections_identical": (a["selections"] == b["selections"] if a["planned_selections"]
                                     == b["planned_selections"] and not a["graphs"]["graph_replays"]
                                     and not b["graphs"]["graph_replays"] else None),
            "planned_selections": [a["planned_selections"], b["planned_selections"]],
            "counters_identical": a["counters"] == b["counters"],
            "max_abs_logit_diff": (a["logits"] - b["logits"]).abs().max().item(),
            "max_abs_logit": a["logits"].abs().max().item(),
            "steps": a["logits"].shape[0],
            "file_mib": a["file_bytes"] / 2**20,
            "save_s": a["save_s"],
            "load_s": b["load_s"],
            "counters": a["counters"],
            "graphs": [a["graphs"], b["graphs"]],
            "tokens": a["tokens"],
        }
        rows.append(row)
        selections = ("not compared (graph replays)" if row["selections_identical"] is None
                      else row["selections_identical"])  # fmt: skip
        print(f"{name:>12}: tokens {row['tokens_identical']}, selections {selections} "
              f"({row['planned_selections'][0]} planned), replays {row['graphs'][0]['graph_replays']} / "
              f"{row['graphs'][1]['graph_replays']}, counters {row['counters_identical']}, logits within "
              f"{row['max_abs_logit_diff']:.2e} of {row['max_abs_logit']:.1f} over {row['steps']} steps x "
              f"{args.batch}; file {row['file_mib']:,.0f} "
              f"MiB, save {row['save_s']:.2f} s, load {row['load_s']:.2f} s", flush=True)  # fmt: skip
    if args.out:
        write_results(args.out, {"metadata": run_metadata(args), "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
