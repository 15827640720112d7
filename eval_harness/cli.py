"""``eval RECIPE [--set key=value ...]``: run a study from a recipe and write its report.

Usage (``hf-offload eval`` and ``python -m eval_harness`` are the same command)::

    hf-offload eval recipes/ruler_qwen05.yaml --set model=/models/qwen05 --set samples=10
    hf-offload eval ruler_qwen05 --dry-run          # show the resolved recipe and stop
    hf-offload eval ruler_qwen05 --report-only      # regenerate docs/results/ruler_qwen05.md

This module loads the model with transformers' Auto classes and builds the caches (``dense``: ``DynamicCache``;
any other method: ``hf_offload.OffloadCache(model, budget_tokens=budget, selector=method, **recipe.offload)``); the
rest of :mod:`eval_harness` only receives them.
"""

from __future__ import annotations

import argparse
import json
import sys

from .recipes import Recipe, load_recipe, valid_keys
from .report import write_report
from .runner import run_study


def load_model(recipe: Recipe):
    """The recipe's model (eval mode, on its device) and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(recipe.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if recipe.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, recipe.dtype)
    if not recipe.gguf_file and not recipe.tokenizer:
        # Registry names of hf_offload.tools.models (e.g. "qwen05") are fetched and converted once; any other name or
        # path goes to from_pretrained unchanged.
        from hf_offload.tools import models

        model, tokenizer = models.load(
            recipe.model, dtype=dtype, device=device, attn_implementation=recipe.attn_implementation
        )
        return model.eval(), tokenizer
    extra = {"gguf_file": recipe.gguf_file} if recipe.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(recipe.tokenizer or recipe.model, **extra)
    model = AutoModelForCausalLM.from_pretrained(
        recipe.model, dtype=dtype, attn_implementation=recipe.attn_implementation, **extra
    )
    return model.to(device).eval(), tokenizer


def default_make_cache(model, offload_kwargs: dict | None = None):
    """``make_cache(method, budget_tokens)``: ``DynamicCache`` for ``dense``, else an ``OffloadCache``."""
    offload_kwargs = dict(offload_kwargs or {})

    def make_cache(method: str, budget_tokens):
        if method == "dense":
            from transformers import DynamicCache

            from hf_offload import disable_offload_attention

            disable_offload_attention(model)  # a pristine dense baseline (a no-op if never switched)
            return DynamicCache(config=model.config)
        from hf_offload import OffloadCache

        return OffloadCache(model, budget_tokens=budget_tokens, selector=method, **offload_kwargs)

    return make_cache


def build_suite(recipe: Recipe, tokenizer):
    """The recipe's suite."""
    if recipe.suite == "ruler":
        from .ruler import RulerSuite

        if recipe.samples is None:
            raise ValueError("RULER generates its samples: set `samples` to a number (e.g. 50)")
        return RulerSuite(tokenizer, recipe.samples, seed=recipe.seed, chat=recipe.chat)
    from .longbench import LongBenchSuite

    return LongBenchSuite(
        tokenizer, data=recipe.data, e=recipe.suite == "longbench_e", samples=recipe.samples, seed=recipe.seed,
        chat=recipe.chat,
    )  # fmt: skip


def run_recipe(recipe: Recipe, model=None, tokenizer=None, make_cache=None, progress: bool = True, fail_fast=False):
    """Run a study (loading the model unless given) and write its report; returns the run summary."""
    if make_cache is None:
        from hf_offload import get_selector

        for method in recipe.methods:
            if method != "dense":
                get_selector(method)  # an unknown method fails here, before the model loads
    if model is None:
        model, tokenizer = load_model(recipe)
    suite = build_suite(recipe, tokenizer)
    summary = run_study(
        study=recipe.study,
        suite=suite,
        model=model,
        tokenizer=tokenizer,
        make_cache=make_cache or default_make_cache(model, recipe.offload),
        tasks=recipe.tasks,
        lengths=recipe.lengths,
        methods=recipe.methods,
        budgets=recipe.budgets,
        budget_min_tokens=recipe.budget_min_tokens,
        results_dir=recipe.results_dir,
        batch_size=recipe.batch_size,
        prefill_chunk_size=recipe.prefill_chunk_size,
        max_new_tokens=recipe.max_new_tokens,
        settings=recipe.to_dict(),
        progress=progress,
        fail_fast=fail_fast,
    )
    return summary


def main(argv=None) -> int:
    """``eval RECIPE [--set key=value ...] [--dry-run] [--report-only] [--no-report] [--fail-fast]``."""
    p = argparse.ArgumentParser(
        prog="eval", description="Run an evaluation study from a recipe (RULER / LongBench over methods x budgets).",
        epilog=f"recipe keys: {', '.join(valid_keys())}",
    )  # fmt: skip
    p.add_argument("recipe", help="a YAML file, or the name of one in recipes/ (e.g. ruler_qwen05)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (value read as YAML); repeatable")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--report-only", action="store_true", help="only regenerate the report from existing results")
    p.add_argument("--no-report", action="store_true", help="do not write the report after the run")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing sample")
    args = p.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"eval: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(recipe.to_dict(), indent=1))
        return 0
    if not args.report_only:
        try:
            summary = run_recipe(recipe, fail_fast=args.fail_fast)
        except ValueError as err:  # settings that only the suite or the library can check
            print(f"eval: {err}", file=sys.stderr)
            return 2
        print(f"{recipe.study}: ran {summary.ran}, skipped {summary.skipped} (done before), failed {summary.failed}; "
              f"results in {summary.path or 'no new file'}")  # fmt: skip
    if not args.no_report:
        try:
            print(f"wrote {write_report(recipe.study, recipe.results_dir, recipe.report_dir, plots=recipe.plots)}")
        except FileNotFoundError as err:
            print(f"eval: {err}", file=sys.stderr)
            return 1
    return 0
