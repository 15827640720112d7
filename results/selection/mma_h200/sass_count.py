"""Instruction mix of the tensor-core scoring kernel's main loop, compiled for sm_90 on a machine without a GPU.

Needs ``libnvrtc.so.12`` (the ``nvidia-cuda-nvrtc-cu12`` wheel, unpacked; path as the first argument) and Triton's
wheel (its ``ptxas`` and ``cuobjdump``). Compiles ``hf_offload.kernels.quantkey_mma._SOURCE`` with the defines the
module's ``_kernel`` uses (default settings), assembles it, and counts the instructions between the main loop's
label and its backward branch (one block per iteration, 64 codes per thread at head_dim 128, 2 bits)::

    python results/selection/mma_h200/sass_count.py /tmp/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 \\
        > results/selection/mma_h200/sass_count.txt
"""

import collections
import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import triton  # noqa: E402

from hf_offload.kernels import quantkey_mma as m  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def sass(lib, head_dim: int, bits: int, decode: str) -> str:
    magic = decode == "magic"
    bexp, aexp = (0, 0) if magic else (m.SHIFT, 133 - m.SHIFT)
    defines = {"D": head_dim, "BITS": bits, "WARPS": m.WARPS, "MAGIC": int(magic), "BEXP": bexp, "AEXP": aexp,
               "PREFETCH": int(m.PREFETCH), "UNROLL": m.UNROLL}  # fmt: skip
    src = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + m._SOURCE
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=compute_90"]
    if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
        raise RuntimeError("NVRTC failed")
    n = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_bytes(re.sub(rb"\.version \d+\.\d+", b".version 8.7", ptx.value))  # older ptxas
        subprocess.run([BIN / "ptxas", "-arch=sm_90", f"{d}/k.ptx", "-o", f"{d}/k.cubin"], check=True)
        return subprocess.run([BIN / "cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout


def loop_mix(text: str) -> collections.Counter:
    lines = [line for line in text.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    addr = [int(re.search(r"/\*([0-9a-f]{4})\*/", line).group(1), 16) for line in lines]
    for line, at in zip(lines, addr):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < at:  # the backward branch closes the main loop
            body = [x for x, a in zip(lines, addr) if int(target.group(1), 16) <= a <= at]
            ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", "\n".join(body))
            return collections.Counter(ops)
    raise RuntimeError("no loop found")


if __name__ == "__main__":
    nvrtc = ctypes.CDLL(sys.argv[1])
    for head_dim, bits, decode in ((128, 2, "subnormal"), (128, 4, "subnormal"), (128, 2, "magic")):
        mix = loop_mix(sass(nvrtc, head_dim, bits, decode))
        total = sum(mix.values())
        print(f"head_dim {head_dim}, {bits} bits, {decode}: {total} instructions per block and thread, "
              f"{total / (head_dim * 16 / 32):.2f} per code; {dict(mix.most_common(12))}")  # fmt: skip
