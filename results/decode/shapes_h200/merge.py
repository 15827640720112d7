"""Merge bench_decode.py output files of one shape into one file per shape (``bench_decode_<shape>.json``).

Usage: python merge.py OUT_DIR [--suffix S] FILE...  (out: ``bench_decode_<shape><S>.json``)
  (the runs, skipped configurations and bandwidths of every file of a shape
in one JSON; metadata and model from the first, with every file's commit listed)
"""

import json
import sys
from pathlib import Path

argv = sys.argv[1:]
suffix = ""
if len(argv) > 2 and argv[1] == "--suffix":
    suffix = argv[2]
    del argv[1:3]
out, files = Path(argv[0]), [Path(f) for f in argv[1:]]
by_shape: dict[str, dict] = {}
for f in sorted(files):
    data = json.loads(f.read_text())
    shape = data["model"]["shape"]
    merged = by_shape.setdefault(shape, {**data, "runs": [], "skipped": [], "merged_from": []})
    merged["runs"] += data["runs"]
    merged["skipped"] += data["skipped"]
    merged["merged_from"].append({"file": f.name, "git_commit": data["metadata"]["git_commit"],
                                  "bandwidth": data["bandwidth"], "args": data["metadata"]["args"]})
for shape, data in by_shape.items():
    path = out / f"bench_decode_{shape.replace('-', '')}{suffix}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}: {len(data['runs'])} runs, {len(data['skipped'])} skipped")
