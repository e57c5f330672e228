#!/usr/bin/env python3
"""Runs the official WASI preview 1 test suite (WebAssembly/wasi-testsuite) against ferry.

The suite is not committed. It is looked for in --suite DIR (default: $FERRY_WASI_TESTSUITE,
else ~/.cache/ferry/wasi-testsuite); when absent, the prebuilt tests are cloned from the
suite's `prod/testsuite-base` branch on GitHub. A machine that can reach neither is told so
and the run is skipped (exit 0) unless --require is given.

Each test (`tests/*/testsuite/wasm32-wasip1/*.wasm`, with its optional `.json` spec per
doc/specification.md of the suite) runs as `ferry run --engine E` with the spec's args, env
and root directory (a fresh copy, mounted at `/` as the suite's wasmtime adapter does); the
exit code and, when the spec gives them, stdout and stderr must match.

Failures listed in conformance/wasi-testsuite-known-failures.txt (one test per line, with the
reason after `#`) are reported but do not fail the run; any other failure fails it, and so does
a listed test that now passes (the list must stay true).
"""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE_URL = "https://github.com/WebAssembly/wasi-testsuite"
SUITE_BRANCH = "prod/testsuite-base"


def find_suite(arg):
    d = Path(arg or os.environ.get("FERRY_WASI_TESTSUITE")
             or Path.home() / ".cache/ferry/wasi-testsuite")
    if list(d.glob("tests/*/testsuite/wasm32-wasip1/*.wasm")):
        return d, None
    try:
        tmp = Path(tempfile.mkdtemp())
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", SUITE_BRANCH,
                        SUITE_URL, str(tmp / "suite")], check=True, timeout=120,
                       capture_output=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        if d.exists():
            shutil.rmtree(d)
        shutil.move(str(tmp / "suite"), d)
        return d, None
    except (subprocess.SubprocessError, OSError) as e:
        return None, f"cannot clone {SUITE_URL} ({SUITE_BRANCH}): {e}"


def known_failures():
    path = REPO / "conformance/wasi-testsuite-known-failures.txt"
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, _, why = line.partition("#")
            if name.strip():
                out[name.strip()] = why.strip()
    return out


def run_test(ferry, engine, wasm, spec, store, space=None):
    root = spec.get("root")
    with tempfile.TemporaryDirectory() as work:
        cmd = [ferry, "run", "--engine", "jit" if engine == "js" else engine]
        if root:
            copy = Path(work) / "root"
            shutil.copytree(wasm.parent / root, copy, symlinks=True)
            for junk in copy.rglob("*.cleanup"):
                if junk.is_dir():
                    shutil.rmtree(junk)
                else:
                    junk.unlink()
            cmd += ["--dir", f"{copy}::/"]
        for k, v in spec.get("env", {}).items():
            cmd += ["--env", f"{k}={v}"]
        cmd += [str(wasm), "--"] + spec.get("args", [])
        env = dict(os.environ, FERRY_STORE=str(store))
        env.pop("FERRY_ENGINE", None)
        if engine == "js":
            # Suspended at its first safe point by ferry; all the rest runs in the JavaScript
            # space (Node's V8), from the snapshot pushed to a space.
            env.update(FERRY_SUSPEND_AT_START="1", FERRY_TOKEN=space["token"])
        try:
            p = subprocess.run(cmd, capture_output=True, timeout=120, env=env,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return "timed out after 120 s"
        if engine == "js":
            if p.returncode != 75:
                return NOT_EXERCISED
            k = next(l.split()[1] for l in p.stderr.decode().splitlines() if l.startswith("suspended "))
            push = subprocess.run([ferry, "push", k, "--to", space["url"]], capture_output=True,
                                  env=env, timeout=120)
            if push.returncode != 0:
                return f"push failed: {push.stderr.decode(errors='replace')[:300]}"
            before = p
            try:
                p = subprocess.run([space["node"], str(REPO / "web/ferry-resume.mjs"), "--space",
                                    space["url"], k], capture_output=True, timeout=120, env=env,
                                   stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                return "timed out after 120 s in JavaScript"
            p = subprocess.CompletedProcess(p.args, p.returncode, before.stdout + p.stdout,
                                            before.stderr + p.stderr)
    want = spec.get("exit_code", 0)
    err = p.stderr.decode(errors="replace")
    guest_err = "".join(l for l in err.splitlines(keepends=True)
                        if not l.startswith("ferry: ") and not l.startswith("suspended "))
    if p.returncode != want:
        return f"exit {p.returncode}, expected {want}: {err.strip()[:300]}"
    if "stdout" in spec and p.stdout.decode(errors="replace") != spec["stdout"]:
        return f"stdout {p.stdout[:200]!r}, expected {spec['stdout'][:200]!r}"
    if "stderr" in spec and guest_err != spec["stderr"]:
        return f"stderr {guest_err[:200]!r}, expected {spec['stderr'][:200]!r}"
    return None


# A js-engine test that ended (natively) before its first safe point: a program without a
# loop or a call that can unwind — nothing of it ran in JavaScript.
NOT_EXERCISED = "ended before its first safe point, so nothing ran in JavaScript"


def start_space(ferry, work, stack):
    """A `ferry serve` for the js engine's snapshots; stopped when `stack` closes."""
    node = os.environ.get("FERRY_NODE") or str(
        Path(os.environ.get("FERRY_TOOLS", Path.home() / ".cache/ferry/tools"))
        / "node-24.22.3/bin/node")
    if not Path(node).exists():
        sys.exit(f"wasi-testsuite: {node} is missing: run scripts/fetch-node.sh")
    (work / "token").write_text("wasi-testsuite")
    server = subprocess.Popen([ferry, "serve", "--listen", "127.0.0.1:0", "--store",
                               str(work / "space"), "--token-file", str(work / "token")],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stack.callback(server.kill)
    url = server.stdout.readline().strip().removeprefix("listening on ")
    return {"url": url, "token": "wasi-testsuite", "node": node}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", help="a wasi-testsuite checkout of branch prod/testsuite-base")
    ap.add_argument("--engine", default="all", choices=["jit", "interp", "js", "all"],
                    help="all: jit and interp; js: each test suspended by ferry at its first "
                         "safe point and run on from there by the JavaScript space in Node "
                         "(web/ferry-resume.mjs; needs Node 24, scripts/fetch-node.sh)")
    ap.add_argument("--ferry", default=str(REPO / "target/release/ferry"))
    ap.add_argument("--only", help="only tests whose name contains this")
    ap.add_argument("--require", action="store_true",
                    help="fail (instead of skipping) when the suite cannot be had")
    a = ap.parse_args()
    suite, why = find_suite(a.suite)
    if suite is None:
        print(f"wasi-testsuite: skipped: {why}")
        return 1 if a.require else 0
    engines = ["jit", "interp"] if a.engine == "all" else [a.engine]
    known = known_failures()
    tests = sorted(suite.glob("tests/*/testsuite/wasm32-wasip1/*.wasm"))
    if a.only:
        tests = [t for t in tests if a.only in t.name]
    unexpected = 0
    with tempfile.TemporaryDirectory() as store, contextlib.ExitStack() as stack:
        space = start_space(a.ferry, Path(store), stack) if "js" in engines else None
        for engine in engines:
            passed = 0
            skipped = 0
            for wasm in tests:
                name = f"{wasm.parts[-4]}/{wasm.stem}"
                spec_path = wasm.with_suffix(".json")
                spec = json.loads(spec_path.read_text()) if spec_path.exists() else {}
                if "operations" in spec:
                    failure = "operation-based specs (sockets, http) are not supported"
                else:
                    failure = run_test(a.ferry, engine, wasm, spec, store, space)
                if failure == NOT_EXERCISED:
                    skipped += 1
                    print(f"{engine:<7} {name}: not exercised ({failure})")
                elif failure is None:
                    passed += 1
                    if name in known:
                        print(f"{engine:<7} {name}: passes but is listed as a known failure")
                        unexpected += 1
                elif name in known:
                    print(f"{engine:<7} {name}: known failure ({known[name]})")
                else:
                    print(f"{engine:<7} {name}: FAIL: {failure}")
                    unexpected += 1
            if skipped:
                print(f"{engine:<7} wasi-testsuite wasm32-wasip1: {passed}/{len(tests) - skipped} passed "
                      f"({skipped} more ended before their first safe point)")
            else:
                print(f"{engine:<7} wasi-testsuite wasm32-wasip1: {passed}/{len(tests)} passed")
    if unexpected:
        print(f"{unexpected} unexpected result(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
