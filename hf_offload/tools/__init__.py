"""The command-line tools: ``hf-offload`` (:mod:`.cli`) and its commands ``demo``, ``models``, ``plan`` and ``bench``.

They sit on top of the library and use its public API (and ``eval_harness`` for ``hf-offload eval`` and the demo's
needle prompt); nothing in the library imports them. Real models load with ``hf_offload.tools.models.load``::

    from hf_offload.tools.models import load
    model, tokenizer = load("qwen05")
"""
