#!/usr/bin/env node
// Runs the snapshots of a conformance kit (docs/conformance.md) in this JavaScript engine:
//
//   ferry conformance --keep DIR                     # take the kit's snapshots into DIR
//   ferry serve --listen ADDR --store DIR --token-file F &
//   node web/conformance.mjs --space http://ADDR --token-file F --kit conformance/v5 --manifest DIR/manifest.json [--in node|browser]
//
// Each snapshot is resumed by `ferry-resume.mjs` in a process of its own; what it prints must
// be exactly the rest of the case's expected output (from the offsets the manifest gives),
// and it must exit (or trap) as the case expects. Prints one row per snapshot and a summary;
// exits 0 only when every snapshot passed, or failed as `--known-failures FILE` says it does
// (lines `case<TAB>reason`), so the list stays true.

import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const opt = (name) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const space = opt("--space") ?? process.env.FERRY_SPACE;
const tokenFile = opt("--token-file");
const kitDir = opt("--kit") ?? join(here, "..", "conformance", "v5");
const manifestPath = opt("--manifest");
const only = opt("--only");
const knownPath = opt("--known-failures");
// Where each snapshot is resumed: here, in Node's V8 (ferry-resume.mjs), or in a browser tab
// (browser.mjs: a headless Chromium opening the space's console).
const runner = opt("--in") ?? "node";
// The command that runs each resume: this Node by default; `--node "qemu-aarch64 -L
// /usr/aarch64-linux-gnu …/node"` runs the snapshots in a Node built for another CPU
// (words split on spaces).
const nodeCmd = (opt("--node") ?? process.execPath).split(" ").filter((w) => w !== "");
if (runner !== "node" && runner !== "browser") {
  console.error("--in is node or browser");
  process.exit(64);
}
if (!space || !manifestPath) {
  console.error("usage: conformance.mjs --space URL [--token-file F] [--kit DIR] --manifest DIR/manifest.json [--in node|browser] [--node CMD] [--only TEXT] [--known-failures FILE]");
  process.exit(64);
}

const kit = JSON.parse(readFileSync(join(kitDir, "cases.json"), "utf8"));
const manifest = JSON.parse(readFileSync(manifestPath, "utf8"));
const known = new Map();
if (knownPath) {
  for (const line of readFileSync(knownPath, "utf8").split("\n")) {
    if (line.trim() === "" || line.startsWith("#")) continue;
    const [name, reason] = line.split("\t");
    known.set(name, reason ?? "");
  }
}
const cases = new Map(kit.cases.map((c) => [c.name, c]));
const read = (rel) => (rel ? readFileSync(resolve(kitDir, rel)) : Buffer.alloc(0));

let passed = 0;
let failed = 0;
let expectedFailures = 0;
const surprises = [];
// Which V8, on which CPU, the snapshots run in (the `--node` command may be another Node).
const where = () => {
  const r = spawnSync(nodeCmd[0], [...nodeCmd.slice(1), "-p", "`Node's V8 ${process.versions.v8} on ${process.arch}`"]);
  if (r.status !== 0) {
    console.error(`\`${nodeCmd.join(" ")}\` does not run: ${r.error?.message ?? r.stderr.toString().trim()}`);
    process.exit(64);
  }
  return r.stdout.toString().trim();
};
console.log(`kit ${kitDir} (ferry-conformance v${kit.version}), resumed in ${runner === "node" ? where() : "a browser tab (headless Chromium)"}`);
for (const s of manifest.snapshots) {
  if (only && !s.case.includes(only)) continue;
  const c = cases.get(s.case);
  if (!c) throw new Error(`the manifest names case ${s.case}, which the kit lacks`);
  const stdout = read(c.stdout).subarray(s.stdout_offset);
  const stderr = read(c.stderr).subarray(s.stderr_offset);
  const script = runner === "node" ? "ferry-resume.mjs" : "browser.mjs";
  const run = spawnSync(nodeCmd[0], [...nodeCmd.slice(1), join(here, script), "--space", space, ...(tokenFile ? ["--token-file", tokenFile] : []), s.snapshot], { maxBuffer: 1 << 30 });
  const why = [];
  let err = run.stderr;
  if (c.trap) {
    const line = Buffer.from(`ferry: guest trapped: ${c.trap}\n`);
    if (run.status !== 70 || !err.subarray(err.length - line.length).equals(line)) {
      why.push(`expected the trap \`${c.trap}\`, got exit ${run.status}: ${err.toString().trim().split("\n").pop()}`);
    } else err = err.subarray(0, err.length - line.length);
  } else if (run.status !== (c.exit ?? 0)) {
    why.push(`exit ${run.status}, expected ${c.exit ?? 0}${run.status === 65 || run.status === 1 ? `: ${err.toString().trim().split("\n").pop()}` : ""}`);
  }
  if (!run.stdout.equals(stdout)) why.push(`stdout differs (${run.stdout.length} bytes, expected ${stdout.length})`);
  if (why.length === 0 && !err.equals(stderr)) why.push(`stderr differs (${err.length} bytes, expected ${stderr.length})`);
  const ok = why.length === 0;
  const isKnown = known.has(s.case);
  if (ok) passed++;
  else if (isKnown) expectedFailures++;
  else failed++;
  if (ok && isKnown) surprises.push(s.case);
  const result = ok ? "pass" : isKnown ? `known failure (${known.get(s.case)})` : `FAIL: ${why.join("; ")}`;
  console.log(`${s.case.padEnd(26)} ${s.point.padEnd(26)} ${s.engine.padEnd(7)} ${result}`);
}
console.log(`${passed + failed + expectedFailures} snapshots: ${passed} passed, ${failed} failed, ${expectedFailures} known failures`);
for (const c of new Set(surprises)) console.log(`${c} is listed as a known failure but passed: take it off the list`);
process.exit(failed === 0 && surprises.length === 0 ? 0 : 1);
