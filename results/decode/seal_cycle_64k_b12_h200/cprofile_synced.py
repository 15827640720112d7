"""Where the host time of the slow decode steps goes (cProfile per step) in bench_decode's quantkey-auto run."""
import cProfile, io, pstats, sys, time
import torch
from benchmarks import bench_decode

orig = bench_decode.decode
profiles = []

def decode(model, cache, kw, ids, start, n, mask, clock=None):
    if clock is None:
        return orig(model, cache, kw, ids, start, n, mask, clock)
    for i in range(n):
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        ids = orig(model, cache, kw, ids, start + i, 1, mask, None)
        pr.disable()
        torch.cuda.synchronize()
        profiles.append((time.perf_counter() - t0, i, pr))
        clock.mark()
    return ids

bench_decode.decode = decode
sys.argv = ["bench_decode.py"] + sys.argv[1:]
bench_decode.main()
print("per-step host+sync ms:", [round(p[0] * 1e3) for p in profiles])
for dt, i, pr in sorted(profiles, key=lambda p: -p[0])[:2] + [sorted(profiles, key=lambda p: p[0])[len(profiles) // 2]]:
    print(f"===== step {i}: {dt * 1e3:.1f} ms")
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(20)
    print("\n".join(l[:180] for l in s.getvalue().splitlines() if l.strip()))
