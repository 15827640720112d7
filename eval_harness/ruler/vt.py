"""RULER variable tracking, ``vt`` (Hsieh et al., 2024, section 3.1 "Multi-hop Tracing: Variable Tracking").

A chain of assignments ``VAR A = 12345``, ``VAR B = VAR A``, ... (``num_hops`` hops, so ``num_hops + 1`` variables
with 5-letter upper-case names and a 5-digit value) is hidden line by line in the noise haystack, in order, at
sorted depths drawn from the 40 RULER depths; other chains (``num_chains > 1``) hold other values. The question asks
for every variable that holds the first chain's value, and the answer is the first chain's variable names. As in
RULER, the prompt starts with one solved example (a short chain with 3-letter names in its own noise haystack, about
500 tokens, or a quarter of the prompt when that is shorter). RULER's configuration: 1 chain, 4 hops, 30 new
tokens. Template sentences from RULER's ``scripts/data/synthetic/constants.py`` (Apache-2.0).
"""

from __future__ import annotations

import random
import string

from .haystacks import noise_units
from .niah import RULER_DEPTHS
from .prompt import answer_prefix_text, assemble, chat_frame, compose, encode

MAX_NEW_TOKENS = 30
EXAMPLE_TOKENS = 500


def _templates(value: str, n_vars: int) -> tuple[str, str, str]:
    return (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, "
        f"{n_vars} variables are assigned the value {value}, they are: ",
    )


def _chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int):
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if name not in names:
            names.append(name)
    chains, values = [], []
    for c in range(num_chains):
        own = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        value = str(rng.randint(10000, 99999))
        while value in values:
            value = str(rng.randint(10000, 99999))
        values.append(value)
        statements = [f"VAR {own[0]} = {value}"] + [f"VAR {own[j + 1]} = VAR {own[j]}" for j in range(num_hops)]
        chains.append((own, statements))
    return chains, values


def _body(tokenizer, rng, num_chains: int, num_hops: int, name_len: int, depths):
    """Chains, values, the task text around the context and the assignments as ``(depth, ids)`` signals."""
    chains, values = _chains(rng, num_chains, num_hops, name_len)
    before, after, prefix = _templates(values[0], num_hops + 1)
    signals = []
    for c, (_, statements) in enumerate(chains):
        chain_depths = depths if (depths is not None and c == 0) else sorted(rng.sample(RULER_DEPTHS, num_hops + 1))
        if len(chain_depths) != len(statements):
            raise ValueError(f"vt inserts {len(statements)} assignments per chain; got {len(chain_depths)} depths")
        signals += [(float(d), encode(tokenizer, s + "\n")) for d, s in zip(chain_depths, statements)]
    return chains, values, before, after, prefix, signals


def make_vt_sample(
    tokenizer, prompt_tokens: int, rng: random.Random, chat: bool, num_chains: int = 1, num_hops: int = 4, depths=None
) -> dict:
    """Build one variable-tracking prompt of exactly ``prompt_tokens`` tokens.

    Args:
        tokenizer: the model's tokenizer.
        prompt_tokens: prompt length in tokens (the context length minus the tokens to generate).
        rng: the sample's random generator.
        chat: wrap the user message in the tokenizer's chat template.
        num_chains: chains hidden in the haystack (the first is asked for).
        num_hops: assignments after the first in each chain.
        depths: optional depths in ``[0, 1]`` of the first chain's ``num_hops + 1`` assignments (in chain order).

    Returns:
        ``input_ids``, ``outputs`` (the first chain's variable names), ``depths`` and ``actual_depths`` of the first
        chain's assignments, ``needle_positions`` (their token indices) and ``value``.
    """
    frame = chat_frame(tokenizer, chat)
    # The solved example (RULER's one-shot example), inside the user message before the task.
    ex_budget = min(EXAMPLE_TOKENS, prompt_tokens // 4)
    ex_chains, _, ex_before, ex_after, ex_prefix, ex_signals = _body(tokenizer, rng, num_chains, num_hops, 3, None)
    ex_before_ids = encode(tokenizer, ex_before)
    ex_after_ids = encode(tokenizer, ex_after + ex_prefix + " ".join(ex_chains[0][0]) + "\n")
    ex_fill = ex_budget - len(ex_before_ids) - len(ex_after_ids) - sum(len(ids) for _, ids in ex_signals)
    example = ex_before_ids + assemble(noise_units(tokenizer), max(ex_fill, 1), ex_signals).ids + ex_after_ids

    chains, values, before, after, prefix, signals = _body(tokenizer, rng, num_chains, num_hops, 5, depths)
    before_ids = example + encode(tokenizer, before)
    after_ids = encode(tokenizer, after)
    answer_ids = encode(tokenizer, answer_prefix_text(prefix, frame))
    fixed = len(frame.head) + len(before_ids) + len(after_ids) + len(frame.tail) + len(answer_ids)
    fill = prompt_tokens - fixed - sum(len(ids) for _, ids in signals)
    if fill < 1:
        raise ValueError(
            f"a {prompt_tokens}-token prompt leaves no room for the vt haystack: example, template and assignments "
            f"take {prompt_tokens - fill} tokens; raise the length"
        )
    built = assemble(noise_units(tokenizer), fill, signals)
    offset = len(frame.head) + len(before_ids)
    first = num_hops + 1
    return {
        "input_ids": compose(frame, before_ids, built.ids, after_ids, answer_ids),
        "outputs": list(chains[0][0]),
        "depths": [d for d, _ in signals[:first]],
        "actual_depths": built.actual_depths[:first],
        "needle_positions": [offset + p for p in built.positions[:first]],
        "value": values[0],
    }
