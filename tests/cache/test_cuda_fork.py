"""A fork refilled for the next questions (``OffloadCache.fork(into=...)``) on CUDA: its decode replays the CUDA
graphs it captured for its first answer, and gives the tokens of a new fork, which captures its own. Skipped
without CUDA (and Triton: graphs need the kernel transfer path)."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache, release_parked

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import build_model, left_padded

pytestmark = [pytest.mark.cuda, pytest.mark.triton]

DOCUMENT, QUESTION, NEW = 150, 6, 16


@pytest.mark.parametrize("admission", ["always", "auto"])
@pytest.mark.parametrize("selector", [None, "quantkey"])
def test_a_refilled_fork_replays_its_graphs_and_answers_as_a_new_fork(selector, admission):
    release_parked()
    model = build_model("llama").cuda()
    options = dict(SMALL, admission=admission, **({} if selector is None else {"selector": selector}))
    document = left_padded([DOCUMENT] * 2, seed=3)[0].cuda()
    prefix = OffloadCache(model, **options)
    with torch.no_grad():
        model(input_ids=document, attention_mask=torch.ones_like(document), past_key_values=prefix)

    def answer(cache, seed):
        questions = left_padded([QUESTION] * 2, seed=seed)[0].cuda()
        ids = torch.cat([document, questions], dim=1)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)  # fmt: skip
        torch.cuda.synchronize()
        return out, cache.stats()

    reused = prefix.fork()
    layers = len(reused.offload_layers)
    for seed in (1, 2, 3, 4):
        expected, new = answer(prefix.fork(), seed)
        assert new["layer_graph_captures"] > 0
        cache = reused if seed == 1 else prefix.fork(into=reused)
        got, stats = answer(cache, seed)
        assert torch.equal(got, expected), seed
        assert stats["decode_recalled_blocks"] == new["decode_recalled_blocks"]
        if seed > 1:
            assert stats["layer_graph_captures"] == 0 and stats["graph_captures"] == 0, stats
            assert stats["layer_graph_replays"] >= (NEW - 2) * layers
    assert prefix.get_seq_length() == DOCUMENT
    release_parked()


@pytest.mark.parametrize("admission", ["always", "auto"])
def test_questions_replay_their_layers_graphs_and_answer_as_op_by_op(admission):
    release_parked()
    model = build_model("llama").cuda()
    document = left_padded([DOCUMENT] * 2, seed=5)[0].cuda()

    def ask(**options):
        prefix = OffloadCache(model, **SMALL, admission=admission, **options)
        with torch.no_grad():
            model(input_ids=document, attention_mask=torch.ones_like(document), past_key_values=prefix)
        fork, answers, counts = None, [], []
        for seed, n in enumerate((6, 11, 20, 9)):  # one graph length (32) for all
            fork = prefix.fork(into=fork)
            ids = torch.cat([document, left_padded([n] * 2, seed=seed)[0].cuda()], dim=1)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=fork,
                                     max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)  # fmt: skip
            torch.cuda.synchronize()
            answers.append(out)
            stats = fork.stats()
            counts.append((stats["question_graph_captures"], stats["question_graph_replays"]))
        return answers, counts, len(fork.offload_layers)

    expected, none, _ = ask(cuda_graphs=False)
    got, counts, layers = ask()
    assert none == [(0, 0)] * 4
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # The first question (a new fork) op by op; captured at the second (the first refill), replayed by every question
    # after it (each refill keeps the graphs).
    assert counts == [(0, 0), (layers, layers), (0, layers), (0, layers)]
