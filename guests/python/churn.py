# A CPython guest that writes its memory faster than a slow link carries it (for moves with
# `migrate --auto-converge`, docs/migration.md): a 24 MiB buffer of pseudo-random bytes,
# rewritten at one pseudo-random place per step of pure-Python work; every 1000 steps it
# prints the step, a running sum and a digest of the buffer. Deterministic: an interrupted
# run prints what an uninterrupted one does.
# usage: churn.py STEPS
import hashlib
import sys

steps = int(sys.argv[1])
buf = bytearray(
    b"".join(hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range((24 << 20) // 32))
)
x = 88172645463325252
acc = 0
for i in range(steps):
    x ^= (x << 13) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 7
    x ^= (x << 17) & 0xFFFFFFFFFFFFFFFF
    buf[x % len(buf)] = x & 255
    acc = (acc + sum(range(i % 7000 + 8000))) % 1000003
    if i % 1000 == 0:
        print(i, acc, hashlib.sha256(buf).hexdigest()[:16], flush=True)
print("done", acc, hashlib.sha256(buf).hexdigest())
