import time, numpy as np, torch, sys
sys.path.insert(0, "tests")
from test_mover_gpu import _pair, _ids, SPIN
from kvswap import BlockMover
rng = np.random.default_rng(5)
src, dst = _pair("mla", "h2d", seed=6)
mover = BlockMover(src.tensors, dst.tensors, "h2d")
print(mover._fn.explain() if hasattr(mover, "_fn") else [a for a in dir(mover) if not a.startswith("__")])
jobs = [_ids(rng, int(rng.integers(1, 9)), src, dst) for _ in range(64)]
for job in jobs: mover.submit(*job)
mover.wait(); mover.poll()
with torch.cuda.stream(mover.stream):
    torch.cuda._sleep(4 * SPIN)
t = time.time()
ids = [mover.submit(sid, did) for sid, did in jobs]
print("64 submits took", time.time() - t, "s")
t = time.time(); r = mover.poll(); print("poll", len(r), time.time() - t)
print("mover.stream", mover.stream.cuda_stream, "current", torch.cuda.current_stream().cuda_stream)
mover.wait()
