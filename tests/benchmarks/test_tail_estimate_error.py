"""benchmarks/tail_estimate_error.py on synthetic captures: pairing, the key check, and errors that order as they
must (an 8-bit estimate of the tail far closer to dense attention than the selection alone)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import tail_estimate_error as te

MODEL = "tiny-model"


def _write_captures(tmp_path, prompt=600, layers=2, heads=2, group=2, dim=16, steps=2, seed=0, other_keys=False):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, heads, prompt + steps, dim, generator=g) * 2
    values = torch.randn(layers, heads, prompt, dim, generator=g)
    qdir, kvdir = tmp_path / "q", tmp_path / "kv"
    qdir.mkdir(), kvdir.mkdir()
    torch.save({"queries": torch.randn(steps, layers, heads, group, dim, generator=g), "keys": keys,
                "positions": torch.arange(prompt - 1, prompt - 1 + steps), "scaling": dim**-0.5},
               qdir / f"{MODEL}-niah_single_1-4096-s1-0-d{steps}.pt")  # fmt: skip
    kv_keys = keys[:, :, :prompt] + (1.0 if other_keys else 0.0)
    torch.save({"kv": [torch.stack([kv_keys[l], values[l]]) for l in range(layers)]},
               kvdir / f"{MODEL}-niah_single_1-4096-s1-0-abcd.pt")  # fmt: skip
    return qdir, kvdir


def test_errors_order_and_bytes(tmp_path):
    qdir, kvdir = _write_captures(tmp_path)
    out = tmp_path / "err.json"
    variants = ["oracle", "quantkey[bits=8]", "quantkey[bits=8,tail_bits=8]", "quantkey[bits=2]+mean-values"]
    assert te.main(["--query-dir", str(qdir), "--kv-dir", str(kvdir), "--model", MODEL, "--budget", "128",
                    "--variants", *variants, "--out", str(out)]) == 0  # fmt: skip
    summary = json.loads(out.read_text())["summary"]
    err = {v: summary[v]["relative_error"] for v in variants}
    assert err["quantkey[bits=8,tail_bits=8]"] < 0.1 * err["quantkey[bits=8]"]
    assert err["oracle"] <= err["quantkey[bits=8]"] + 1e-3
    assert 0 < err["quantkey[bits=2]+mean-values"] < 1.5
    b = {v: summary[v]["summary_bytes_per_block_head_bf16"] for v in variants}
    # 16-token blocks, 16 channels, bf16: 8-bit codes 16 * 16 bytes plus min and step (2 * 16 * 2) per keys / values.
    assert b["quantkey[bits=8]"] == 16 * 16 + 64 and b["quantkey[bits=8,tail_bits=8]"] == 2 * (16 * 16 + 64)
    assert b["quantkey[bits=2]+mean-values"] == 16 * 16 // 4 + 64 + 16 * 2
    assert b["oracle"] == 2 * 16 * 16 * 2


def test_mismatched_keys_are_refused(tmp_path):
    qdir, kvdir = _write_captures(tmp_path, other_keys=True)
    with pytest.raises(ValueError, match="differ"):
        te.main(["--query-dir", str(qdir), "--kv-dir", str(kvdir), "--model", MODEL, "--budget", "128"])


def test_no_pair_is_an_error(tmp_path):
    (tmp_path / "q").mkdir(), (tmp_path / "kv").mkdir()
    assert te.main(["--query-dir", str(tmp_path / "q"), "--kv-dir", str(tmp_path / "kv"), "--model", MODEL]) == 2
