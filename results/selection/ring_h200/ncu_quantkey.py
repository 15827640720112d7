"""Launch the tensor-core scoring kernel at the 8B shape, 64K tokens, batch 12 (4,096 blocks per sequence and KV head)
for Nsight Compute: 2 and 4 bits, without and with the ring of asynchronous copies (``STAGES`` 0 and 2), two
launches each (the profiler takes the second of each). Run under ``ncu --kernel-name quantkey_mma``."""

import torch

from hf_offload.kernels import quantkey_mma

g = torch.Generator().manual_seed(0)
b, n, h, group, d = 12, 4096, 8, 4, 128
for bits in (2, 4):
    codes = torch.randint(0, 256, (b, n, h, 16, d * bits // 8), dtype=torch.uint8, generator=g).cuda()
    kmin = (torch.randn(b, n, h, d, generator=g) - 2).to(torch.bfloat16).cuda()
    kstep = (torch.rand(b, n, h, d, generator=g) * 4 / ((1 << bits) - 1)).to(torch.bfloat16).cuda()
    query = (torch.randn(b, h, group, d, generator=g) * d**-0.5).cuda()
    out = torch.empty(b, h, group, n, device="cuda")
    for stages in (0, 2):
        quantkey_mma.STAGES = stages
        for _ in range(2):
            quantkey_mma.launch(query, codes, kmin, kstep, out, block_stride=n, bits=bits)
        torch.cuda.synchronize()
        print(f"bits {bits} stages {stages} launched", flush=True)
