"""Questions over a shared prefix (a fork's first later prefill chunk) replayed from a graph of their decoder layer,
on the CPU.

CUDA graphs need a GPU (``tests/cache/test_cuda_fork.py``). Here a stand-in "graph" records the padded call at
capture time and runs it again at each replay (in the mode a capture records), so that everything the host does
around a replay is exercised: which calls are served, the padded static inputs, the append and seals after a
replay, the counters, and the fallback when a capture fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.cache import OffloadLayer
from hf_offload.cache.capture import CapturedLayer, Padding, StaticInputs
from hf_offload.cache.graphs import QUESTION_GRAPH_TOKENS, question_tokens

from ..helpers import TINY_PREFILL, TINY_SPARSE, VOCAB, build_model, left_padded

DOCUMENT, NEW = 61, 4


class _Replay:
    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


@pytest.fixture
def question_captures(monkeypatch):
    """Offloaded layers on the CPU capture stand-in question graphs (decode steps run op by op); returns the set of
    layer indices whose capture fails (an index plus 100: whose replays give wrong outputs)."""
    fail: set[int] = set()
    resolve = OffloadLayer.resolve

    def resolve_with_graphs(self):
        resolve(self)
        if self.config.cuda_graphs is not False:
            self.execution.graphs = True
            statics = StaticInputs()
            layer = self

            def capture(device, forward, args, kwargs, held, pad=None):
                assert pad is not None, "only questions are captured here"
                if layer.layer_idx in fail:
                    raise RuntimeError("operation not permitted when stream is capturing")
                buffers, static_args, static_kwargs = statics.load(args, kwargs, pad=pad)
                captured = CapturedLayer(graph=None, statics=buffers, inputs=statics, out=None, held=held)

                def run():  # a graph's replay changes no counter on the host: the runner adds what one call counts
                    totals = layer.stats.totals_snapshot()
                    captured.out = forward(*static_args, **static_kwargs)
                    layer.stats.restore_totals(totals)
                    if layer.layer_idx + 100 in fail:
                        captured.out[0].add_(1.0)

                captured.graph = _Replay(run)
                return captured

            self.graphs._capture_layer = capture
            # Decode steps op by op: only the questions are under test.
            self.graphs.layer_step = lambda args, kwargs: None
            self.graphs._capture_decode = lambda *a, **k: None
            self.graphs.seal_graphs = False

    monkeypatch.setattr(OffloadLayer, "resolve", resolve_with_graphs)
    return fail


def _ask(model, settings, questions, rows=1, refill=True, **options):
    """Greedy answers to each of ``questions`` (token tensors ``[rows, q]``) after one prefilled document, each
    asked through a fork of the prefix (refilled for the next question where ``refill``); with the last fork."""
    g = torch.Generator().manual_seed(7)
    document = torch.randint(3, model.config.vocab_size, (rows, DOCUMENT), generator=g)
    prefix = OffloadCache(model, **settings, **options)
    with torch.no_grad():
        model(input_ids=document, past_key_values=prefix)
    answers, fork, counts = [], None, []
    for question in questions:
        fork = prefix.fork(into=fork if refill else None)
        ids = torch.cat([document, question], dim=1)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=fork,
                                 max_new_tokens=NEW, do_sample=False)  # fmt: skip
        answers.append(out[:, ids.shape[1]:])
        counts.append((_captures(fork), _replays(fork), fork.stats()))  # the counters start again at each refill
    return answers, fork, counts


def _questions(lengths, rows=1, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (rows, n), generator=g) for n in lengths]


def _captures(cache):
    return [int(layer.stats.question_graph_captures) for layer in cache.offload_layers]


def _replays(cache):
    return [int(layer.stats.question_graph_replays) for layer in cache.offload_layers]


COUNTERS = ("recalled_blocks", "recalled_bytes", "offloaded_bytes", "host_kv_bytes", "decode_steps")


@pytest.mark.parametrize("settings", [TINY_PREFILL, TINY_SPARSE], ids=["full", "sparse"])
def test_replayed_questions_answer_as_op_by_op(arch, settings, question_captures):
    model = build_model(arch)
    lengths = [5, 9, 20, 3, 13]  # one padded length (32) for all; 9, 20 and 13 fill blocks of 8 tokens
    questions = _questions(lengths, rows=2)
    expected, eager, eager_counts = _ask(model, settings, questions, rows=2, cuda_graphs=False)
    got, graphed, counts = _ask(model, settings, questions, rows=2)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    layers = len(graphed.offload_layers)
    # The first question (a new fork) ran op by op; the second (the first refill) captured its layers' graphs, and
    # every question after it replayed them (each refill kept them).
    assert [c for c, _, _ in counts] == [[0] * layers, [1] * layers] + [[0] * layers] * (len(questions) - 2)
    assert [r for _, r, _ in counts] == [[0] * layers] + [[1] * layers] * (len(questions) - 1)
    for (_, _, a), (_, _, b) in zip(eager_counts, counts):
        for name in COUNTERS:
            assert a[name] == b[name], name
    # The same cache state: the padded call's products may round differently from the call's own (matrix products
    # of another size), so values agree to float32 rounding.
    close = {"rtol": 1e-5, "atol": 1e-5}
    for layer, other in zip(graphed.offload_layers, eager.offload_layers):
        assert layer.n_tokens == other.n_tokens and layer.n_blocks == other.n_blocks
        assert torch.equal(layer.blocks.block_table, other.blocks.block_table)
        for name, summary in other.blocks.summaries.items():
            torch.testing.assert_close(layer.blocks.summaries[name], summary, **close)
        ids = layer.blocks.block_table.flatten()
        torch.testing.assert_close(layer.blocks.host.read(ids), other.blocks.host.read(ids), **close)
        torch.testing.assert_close(layer.keys, other.keys, **close)


def test_only_a_refilled_forks_first_chunk_of_question_length_replays(question_captures):
    model = build_model("llama")
    # A question longer than a graph takes runs op by op.
    long = _questions([QUESTION_GRAPH_TOKENS + 1] * 2)
    _, _, counts = _ask(model, TINY_PREFILL, long)
    assert [c for c, _, _ in counts] == [[0, 0], [0, 0]]
    # A new fork's question runs op by op; so do questions of a fork that is never refilled.
    _, _, counts = _ask(model, TINY_PREFILL, _questions([5, 6]), refill=False)
    assert [c for c, _, _ in counts] == [[0, 0], [0, 0]] and [r for _, r, _ in counts] == [[0, 0], [0, 0]]
    # Padded questions (several sequences of different lengths) run op by op.
    document = torch.randint(3, VOCAB, (2, DOCUMENT), generator=torch.Generator().manual_seed(1))
    prefix = OffloadCache(model, **TINY_PREFILL)
    with torch.no_grad():
        model(input_ids=document, past_key_values=prefix)
    ids, mask = left_padded([6, 9], seed=4)
    fork = prefix.fork(into=prefix.fork())
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.cat([torch.ones(2, DOCUMENT, dtype=mask.dtype), mask], 1),
              past_key_values=fork)  # fmt: skip
    assert _captures(fork) == [0] * len(fork.offload_layers)
    # A second chunk after the question (the next turn of a conversation) runs op by op.
    fork = prefix.fork(into=fork)
    for n in (6, 7):
        with torch.no_grad():
            model(input_ids=torch.randint(3, VOCAB, (2, n)), past_key_values=fork)
    assert _captures(fork) == [1] * len(fork.offload_layers)
    assert _replays(fork) == [1] * len(fork.offload_layers)


@pytest.mark.parametrize(
    ("failing", "message", "captures", "replays"),
    [
        # Layer 1's capture fails: layer 0 captured at the second question (the first refill) and replayed from then
        # on; layer 1 ran every question op by op.
        (1, "capturing a question's decoder layer", [[0, 0], [1, 0], [0, 0]], [[0, 0], [1, 0], [1, 0]]),
        # Layer 0's graph gives wrong outputs: its capture (second question) answered from its op-by-op run, then
        # the layer ran op by op.
        (100, "did not reproduce", [[0, 0], [1, 1], [0, 0]], [[0, 0], [0, 1], [0, 1]]),
    ],
    ids=["capture-fails", "replay-differs"],
)
def test_a_question_graph_that_fails_warns_once_and_the_layer_answers_op_by_op(question_captures, failing, message,
                                                                               captures, replays):  # fmt: skip
    model = build_model("llama")
    question_captures.add(failing)
    questions = _questions([5, 7, 6])
    expected, _, _ = _ask(model, TINY_PREFILL, questions, cuda_graphs=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _, counts = _ask(model, TINY_PREFILL, questions)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    messages = [str(w.message) for w in caught if "question" in str(w.message)]
    assert len(messages) == 1 and message in messages[0] and "op by op" in messages[0]
    assert f"Layer {failing % 100}" in messages[0]
    assert [c for c, _, _ in counts] == captures
    assert [r for _, r, _ in counts] == replays


def test_padding_of_a_call_and_its_buffers():
    pad = Padding(tokens=5, padded=32, batch=2)
    hidden, cos = torch.randn(2, 5, 16), torch.randn(1, 5, 4)
    positions, cache_position = torch.arange(5)[None], torch.arange(5)
    assert [pad.token_dim(t) for t in (hidden, cos, positions, cache_position)] == [1, 1, 1, 0]
    assert pad.token_dim(torch.randn(3, 5)) is None and pad.token_dim(torch.randn(16)) is None
    assert pad.shape(hidden) == (2, 32, 16) and pad.shape(cache_position) == (32,)
    statics = StaticInputs()
    buffers, args, kwargs = statics.load((hidden,), {"position_embeddings": cos, "cache_position": cache_position},
                                         pad=pad)  # fmt: skip
    assert args[0].shape == (2, 32, 16) and torch.equal(args[0][:, :5], hidden) and not args[0][:, 5:].any()
    assert torch.equal(kwargs["cache_position"][:5], cache_position)
    # A shorter call of the same padded length reads the same buffers, its values in front.
    shorter = {"position_embeddings": cos[:, :3], "cache_position": cache_position[:3]}
    again, _, _ = statics.load((hidden[:, :3],), shorter, pad=Padding(3, 32, 2))
    assert all(a is b for a, b in zip(again, buffers))
    assert torch.equal(args[0][:, :3], hidden[:, :3])
    out = torch.randn(2, 32, 16)
    assert torch.equal(pad.trim(out), out[:, :5]) and pad.trim(torch.randn(4)).shape == (4,)
    assert [question_tokens(n) for n in (2, 32, 33, 100, 512)] == [32, 32, 64, 128, 512]


@pytest.mark.triton
def test_replayed_questions_on_the_kernel_path(question_captures):
    """The kernel path's recall of the earlier blocks (kept index arrays: a capture makes its own) under the stand-in
    graphs: the answers of op by op, captured once, replayed by every question."""
    model = build_model("llama")
    settings = dict(TINY_PREFILL, transfer="kernel")
    questions = _questions([5, 12, 9], rows=2)
    expected, _, _ = _ask(model, settings, questions, rows=2, cuda_graphs=False)
    got, graphed, counts = _ask(model, settings, questions, rows=2)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    layers = len(graphed.offload_layers)
    assert [c for c, _, _ in counts] == [[0] * layers, [1] * layers, [0] * layers]
    assert [r for _, r, _ in counts] == [[0] * layers, [1] * layers, [1] * layers]
