"""Launch the current scoring kernel at 64K/b12 (8B shape) twice per bits, bf16 query with scaling, as decode does."""
import torch
from hf_offload.kernels import quantkey_mma

g = torch.Generator().manual_seed(0)
b, n, h, group, d = 12, 4096, 8, 4, 128
for bits in (2,):
    codes = torch.randint(0, 256, (b, n, h, 16, d * bits // 8), dtype=torch.uint8, generator=g).cuda()
    kmin = (torch.randn(b, n, h, d, generator=g) - 2).to(torch.bfloat16).cuda()
    kstep = (torch.rand(b, n, h, d, generator=g) * 4 / ((1 << bits) - 1)).to(torch.bfloat16).cuda()
    query = torch.randn(b, h, group, d, generator=g).to(torch.bfloat16).cuda()
    out = torch.empty(b, h, group, n, device="cuda")
    for _ in range(3):
        quantkey_mma.launch(query, codes, kmin, kstep, out, block_stride=n, bits=bits, scaling=d**-0.5)
    torch.cuda.synchronize()
    print(f"bits {bits} launched", flush=True)
