# A pure-Python workload for churn tests: dicts, generators, recursion, strings, a file.
import sys


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def squares(limit):
    for i in range(limit):
        yield i * i


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
counts = {}
gen = squares(10**9)
words = []
for step in range(steps):
    total = 0
    for i in range(60000):
        key = (i * 7919 + step) % 257
        counts[key] = counts.get(key, 0) + next(gen) % 1000
        total += i % 13
    words.append("w%d" % (fib(18 + step % 3) % 97))
    print("step %d total %d keys %d sum %d fib %s" % (step, total, len(counts), sum(counts.values()), words[-1]), flush=True)
print("done", " ".join(words))
