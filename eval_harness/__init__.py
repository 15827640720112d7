"""Evaluation of hf_offload on long-context tasks (no model code: the runner receives a model, its tokenizer and a
cache factory).

* :mod:`eval_harness.ruler`: RULER's synthetic tasks (Hsieh et al., 2024) at any length in the model's own tokens;
  ``qa_1`` / ``qa_2`` are not built (they need SQuAD / HotpotQA).
* :mod:`eval_harness.longbench`: LongBench and LongBench-E (Bai et al., 2023) from the published jsonl files.
* :mod:`eval_harness.metrics`: RULER's and LongBench's scores.
* :mod:`eval_harness.runner`: model x method x budget x length, resumable jsonl results under ``results/<study>/``.
* :mod:`eval_harness.report`: ``docs/results/<study>.md`` (and a plot) generated from those results.
* :mod:`eval_harness.files`: reading results files stored plain or gzip-compressed (``.jsonl.gz``, ``.json.gz``).
* :mod:`eval_harness.recipes` and :mod:`eval_harness.cli`: one YAML recipe per study, run with
  ``python -m eval_harness RECIPE [--set key=value ...]``.
* :mod:`eval_harness.needle`: the needle-in-a-haystack prompts of ``benchmarks/needle_core.py``.

Optional packages (the ``eval`` extra): ``datasets`` (reading LongBench through ``load_dataset``; the standard library
is used otherwise), ``jieba`` (the Chinese LongBench metrics), ``matplotlib`` (report plots); ``tqdm`` and ``pyyaml``
come with transformers.
"""
