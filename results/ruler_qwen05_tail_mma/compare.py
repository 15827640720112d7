"""Per-sample comparison of the RULER runs of this folder's README: the default selector with the tensor-core
estimate (this folder), with the Triton `dot` estimate in the same commit (`../ruler_qwen05_tail_dot/`) and with
`dot` at commit `1988f0d` (`../ruler_qwen05_tail/`, its third run). Prints, per context length, the mean scores, how
many samples gave the same answer and how many scored higher or lower.

    python results/ruler_qwen05_tail_mma/compare.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHOD = "quantkey[bits=4,tail_bits=2,tail_near=3]"
RUNS = {
    "mma": sorted(HERE.glob("*.jsonl")),
    "dot": sorted((HERE.parent / "ruler_qwen05_tail_dot").glob("*.jsonl")),
    "dot_1988f0d": [HERE.parent / "ruler_qwen05_tail" / f"ruler_qwen05_tail-20261130T18130{i}Z.jsonl" for i in (1, 4)],
}


def load(files: list[Path]) -> dict[tuple, dict]:
    """The results of ``METHOD`` in ``files``, by (task, length, sample id); a later file's result wins."""
    out = {}
    for path in files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("type") == "result" and r["method"] == METHOD:
                out[(r["task"], r["length"], r["sample_id"])] = r
    return out


def compare(a: dict, b: dict, length: int) -> str:
    keys = [k for k in a if k[1] == length]
    same = sum(a[k]["prediction"] == b[k]["prediction"] for k in keys)
    higher = sum(a[k]["score"] > b[k]["score"] for k in keys)
    lower = sum(a[k]["score"] < b[k]["score"] for k in keys)
    return f"same answer {same}/{len(keys)}, higher {higher}, lower {lower}"


def main() -> None:
    runs = {name: load(files) for name, files in RUNS.items()}
    for length in sorted({k[1] for k in runs["mma"]}):
        means = {n: sum(r["score"] for k, r in d.items() if k[1] == length) / sum(k[1] == length for k in d)
                 for n, d in runs.items()}  # fmt: skip
        print(f"{length}: mean " + ", ".join(f"{n} {m:.2f}" for n, m in means.items()))
        print(f"  mma against dot: {compare(runs['mma'], runs['dot'], length)}")
        print(f"  dot against dot_1988f0d: {compare(runs['dot'], runs['dot_1988f0d'], length)}")


if __name__ == "__main__":
    main()
