"""RULER means and per-sample comparison of plain ``quantkey`` at ``reselect_every`` 1, 2 and 3
(``../ruler_qwen05_reselect{1,2,3}/``, one commit, one call) and of dense attention from ``../ruler_qwen05_tail/``
(same recipe, model and samples). Prints, per context length, the mean scores, and for each reuse interval against
``reselect_every=1`` how many samples gave the same answer and how many scored higher or lower.

    python results/ruler_qwen05_reselect/compare.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(files, method: str) -> dict[tuple, dict]:
    """The results of ``method`` in ``files``, by (task, length, sample id); a later file's result wins."""
    out = {}
    for path in files:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if r.get("type") == "result" and r["method"] == method:
                out[(r["task"], r["length"], r["sample_id"])] = r
    return out


def main() -> None:
    runs = {f"reselect_every={e}": load(sorted((HERE.parent / f"ruler_qwen05_reselect{e}").glob("*.jsonl")), "quantkey")
            for e in (1, 2, 3)}
    runs["dense"] = load(sorted((HERE.parent / "ruler_qwen05_tail").glob("*.jsonl")), "dense")
    base = runs["reselect_every=1"]
    print("| length | " + " | ".join(runs) + " |")
    print("|---|" + "---:|" * len(runs))
    for length in sorted({k[1] for k in base}):
        cells = []
        for d in runs.values():
            keys = [k for k in d if k[1] == length]
            cells.append(f"{sum(d[k]['score'] for k in keys) / len(keys):.1f} ({len(keys)})" if keys else "-")
        print(f"| {length} | " + " | ".join(cells) + " |")
    for name in ("reselect_every=2", "reselect_every=3"):
        for length in sorted({k[1] for k in base}):
            keys = [k for k in base if k[1] == length]
            other = runs[name]
            same = sum(base[k]["prediction"] == other[k]["prediction"] for k in keys)
            higher = sum(other[k]["score"] > base[k]["score"] for k in keys)
            lower = sum(other[k]["score"] < base[k]["score"] for k in keys)
            print(f"{name} against reselect_every=1 at {length}: same answer {same}/{len(keys)}, higher {higher}, "
                  f"lower {lower}")


if __name__ == "__main__":
    main()
