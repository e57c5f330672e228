// The guest's thread in a browser tab: a module worker, so that a guest's sleeps and long
// loops never freeze the page. The page sends {base, token, kappa, cell} (`cell`: an
// Int32Array over a SharedArrayBuffer the page sets to 1 to ask for a suspend, when the page
// is cross-origin isolated); this answers with {out: 1|2, bytes} for the guest's output,
// {progress}, and at the end {code}, {trap}, {suspended: κ hex, sent, bytes} (the snapshot
// written to the space, which verified and named it) or {refused}. With `lease` set (a
// session taken over), an exit or trap also sends the guest's mounts to the space and names
// their trees in `files`. Served by `ferry serve` at /console/worker.js.

import { Refused, SpaceSource } from "./objects.js";
import { SpaceSink, mountTrees } from "./capture.js";
import { prefetch, resume } from "./resume.js";

// Kept across messages: what a pre-copy ({prefetch: κ, base, token}, answered with
// {prefetched: bytes} or {prefetchFailed}) fetched, the resume that follows does not fetch again.
let source = null;

self.onmessage = async ({ data }) => {
  if (data.prefetch) {
    source ??= new SpaceSource(data.base, data.token);
    try {
      self.postMessage({ prefetched: await prefetch(source, data.prefetch) });
    } catch (e) {
      source.drop();
      self.postMessage({ prefetchFailed: e.message });
    }
    return;
  }
  source ??= new SpaceSource(data.base, data.token);
  const sink = new SpaceSink(data.base, data.token);
  try {
    const r = await resume(source, data.kappa, {
      // What the guest showed before the snapshot, when a space kept it (its output log).
      history: (records) => {
        for (const [stream, bytes] of records) self.postMessage({ out: stream, bytes, before: true });
      },
      stdout: (bytes) => self.postMessage({ out: 1, bytes }),
      stderr: (bytes) => self.postMessage({ out: 2, bytes }),
      progress: (progress) => self.postMessage({ progress }),
      suspendCell: data.cell ?? null,
      onCtl: (ctl) => self.postMessage({ ctl }),
      onCheckpoint: ({ kappa }) => self.postMessage({ checkpoint: kappa }),
      sink,
    });
    if (r.suspended) {
      self.postMessage({ suspended: r.suspended, sent: r.sent, bytes: r.bytes });
      return;
    }
    let files;
    if (data.lease) {
      const m = mountTrees(r.mounts);
      await sink.send(m.objects);
      files = m.trees;
    }
    self.postMessage(r.trap ? { trap: r.trap, files } : { code: r.code, files });
  } catch (e) {
    self.postMessage({ refused: e instanceof Refused ? e.message : `${e.name}: ${e.message}` });
  }
};
