"""The table of this folder's README from its JSON files: plain ``quantkey`` (admission "auto") at 64K and 128K
tokens over batches up to and past the one whose KV fits on the device.

    python results/decode/batch_sweep_h200/table.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2**30


def rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    commit = data["metadata"]["git_commit"][:7]
    out = []
    for run in data["runs"]:
        roof, pred = run["roofline"], run["prediction"]
        cells = [run["context"], run["batch"], run["steps"], f"{run['tokens_per_s']:.1f}", f"{run['step_ms']:.2f}",
                 f"{run['admitted_kv_bytes'] / GIB:.1f}", f"{run['host_kv_bytes'] / GIB:.1f}",
                 f"{run['host_recalled_bytes_per_step'] / 1e6:.0f}", f"{run['pcie_gbps']:.1f}",
                 f"{run['hit_rate']:.2f}", f"{roof['hbm_ms']:.2f}", f"{roof['pcie_ms']:.2f}",
                 f"{roof['step_over_roofline']:.2f}", f"{roof['step_over_roofline_with_summaries']:.2f}",
                 f"{run['peak_device_bytes'] / GIB:.1f}", f"{pred['peak_over_predicted']:.3f}",
                 f"`{path.name}` (`{commit}`)"]  # fmt: skip
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return out


def main() -> None:
    print("| context | batch | steps | tok/s | ms/step | KV on device GiB | KV on host GiB | recalled from host MB/step "
          "| PCIe GB/s | hit rate | HBM bound ms | PCIe bound ms | step / roofline | step / roofline with summaries "
          "| peak GiB | peak / predicted | file |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in ("bench_decode_65536_quantkey_batches.json", "bench_decode_131072_quantkey_batches.json"):
        for line in rows(HERE / name):
            print(line)


if __name__ == "__main__":
    main()
