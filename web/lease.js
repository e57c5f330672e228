// A space's session taken over by this JavaScript space (docs/browser.md, "Taking a session
// over"). The space lends the session — a running one is suspended first — and records it as
// `lent` at a raised epoch before answering; from then on it neither runs nor moves it. This
// side resumes the lent snapshot, sends the guest's output to the session's log as it comes
// (so `ferry --space URL logs --follow` shows it), and at the end gives the session back:
// suspended at the snapshot it wrote to the space, ended (exit code or trap, with the files
// its mounts hold), or never run (the resume was refused here). Every call names the epoch;
// once the session is reclaimed (`ferry --space URL reclaim`), the space refuses them all, and
// this copy must stop: it is fenced. Taken with a lease, the session is reclaimed by the space
// itself once it has not heard from this side for that long; this side speaks (an empty
// append) every quarter of the lease while it has nothing to send.
//
// A Lease lives on the thread that is free while the guest runs (the page, or Node's main
// thread): the worker running the guest hands it each output record.

import { Refused, spaceRequest } from "./objects.js";

/** Most bytes of output sent in one request (whole records: a longer record goes alone). */
const SEND_AT_MOST = 8 << 20;
/** How long output keeps being retried while the space cannot be reached. */
const RETRY_FOR_MS = 30000;

export class Lease {
  /**
   * Takes session `id` over from the space at `base`; `client` says who takes it (shown by
   * `ferry --space URL ps`); `leaseMs` (optional, at least 1000) is how long the space waits
   * without word from here before it takes the session back. Throws `Refused` with the
   * space's reason.
   */
  static async take(base, token, id, client, { leaseMs = null } = {}) {
    base = base.replace(/\/+$/, "");
    const body = JSON.stringify(leaseMs ? { client, lease_ms: leaseMs } : { client });
    const r = await spaceRequest(base, token, "POST", `/v1/sessions/${encodeURIComponent(id)}/lend`, body, `the lend of session ${id}`, () => `the space has no session \`${id}\``);
    const lease = new Lease(base, token, id, await r.json());
    if (leaseMs) lease.keepAlive(leaseMs);
    return lease;
  }

  /**
   * Whether session `id` could be taken over now (the space's policy, the session's state):
   * nothing is lent. Throws `Refused` with the space's reason — before a pre-copy, so that a
   * refusal costs no transfer.
   */
  static async check(base, token, id) {
    base = base.replace(/\/+$/, "");
    await spaceRequest(base, token, "POST", `/v1/sessions/${encodeURIComponent(id)}/lend`, JSON.stringify({ client: "", dry_run: true }), `the lend of session ${id}`, () => `the space has no session \`${id}\``);
  }

  constructor(base, token, id, lent) {
    this.base = base;
    this.token = token;
    this.id = id;
    this.epoch = lent.epoch;
    /** The snapshot to resume (`blake3:…`). */
    this.snapshot = lent.snapshot;
    /** Where this side's output starts in the session's log, and where it ends. */
    this.start = lent.log_len;
    this.length = lent.log_len;
    /** How much of the log the space has acknowledged. */
    this.acked = lent.log_len;
    this.buf = new Uint8Array(1 << 16);
    /** End offsets (in the log) of the records written here. */
    this.ends = [];
    this.sending = null;
    /** Set when the space refused this holder (fenced) or output could not be sent. */
    this.failed = null;
    this.onFailed = null;
    /** The session's checkpoint interval (ms), if it has one. */
    this.checkpointEveryMs = lent.session.checkpoint_every_ms ?? null;
    /** Checkpoints being told to the space, in order. */
    this.told = Promise.resolve();
  }

  /** One output record of the guest (`stream` 1 stdout, 2 stderr). */
  write(stream, bytes) {
    if (bytes.length === 0 || this.failed) return;
    const need = this.length - this.start + 5 + bytes.length;
    if (need > this.buf.length) {
      let size = this.buf.length;
      while (size < need) size *= 2;
      const grown = new Uint8Array(size);
      grown.set(this.buf.subarray(0, this.length - this.start));
      this.buf = grown;
    }
    const at = this.length - this.start;
    this.buf[at] = stream;
    new DataView(this.buf.buffer).setUint32(at + 1, bytes.length, true);
    this.buf.set(bytes, at + 5);
    this.length += 5 + bytes.length;
    this.ends.push(this.length);
    this.kick();
  }

  /** Speaks to the space (an empty append) whenever a quarter of the lease went by without. */
  keepAlive(leaseMs) {
    this.heard = Date.now();
    this.beat = setInterval(() => {
      if (this.failed || this.sending || Date.now() - this.heard < leaseMs / 4) return;
      this.sending = this.pump(true).finally(() => {
        this.sending = null;
        this.kick();
      });
    }, Math.max(250, leaseMs / 8));
    this.beat.unref?.();
  }

  stop() {
    if (this.beat) clearInterval(this.beat);
    this.beat = null;
  }

  kick() {
    if (this.sending || this.failed || this.acked >= this.length) return;
    this.sending = this.pump().finally(() => {
      this.sending = null;
      this.kick();
    });
  }

  fail(why) {
    if (this.failed) return;
    this.failed = why;
    this.stop();
    if (this.onFailed) this.onFailed(why);
  }

  /** Sends what the space has not acknowledged, whole records, a batch at a time (`beat`: once, even with nothing to send). */
  async pump(beat = false) {
    let since = null;
    while ((this.acked < this.length || beat) && !this.failed) {
      beat = false;
      const to = this.batchEnd();
      const body = this.buf.slice(this.acked - this.start, to - this.start);
      let r;
      try {
        r = await fetch(`${this.base}/v1/sessions/${encodeURIComponent(this.id)}/output?epoch=${this.epoch}&at=${this.acked}`, {
          method: "POST",
          headers: { Authorization: `Bearer ${this.token}`, "Content-Type": "application/octet-stream" },
          body,
        });
      } catch (e) {
        // The space is out of reach: try again, for a while.
        since ??= Date.now();
        if (Date.now() - since > RETRY_FOR_MS) return this.fail(`cannot reach the space at ${this.base}: ${e.cause?.message ?? e.message}`);
        await new Promise((ok) => setTimeout(ok, 500));
        continue;
      }
      since = null;
      if (r.ok) {
        this.acked = (await r.json()).len;
        this.heard = Date.now();
        continue;
      }
      const len = r.headers.get("ferry-log-len");
      const text = (await r.text()).trim();
      if (r.status === 409 && len !== null && Number(len) >= this.start && Number(len) < this.acked) {
        // The space lost the end of what it had (it restarted): send again from there.
        this.acked = Number(len);
        continue;
      }
      return this.fail(`the space refused this session's output (${r.status}): ${text}`);
    }
  }

  /** Where the next batch from `acked` ends: whole records, at most SEND_AT_MOST bytes unless one record is longer. */
  batchEnd() {
    let lo = 0;
    let hi = this.ends.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.ends[mid] <= this.acked) lo = mid + 1;
      else hi = mid;
    }
    let to = this.ends[lo] ?? this.length;
    for (let i = lo + 1; i < this.ends.length && this.ends[i] - this.acked <= SEND_AT_MOST; i++) to = this.ends[i];
    return to;
  }

  /** Waits until the space holds all the output written here. */
  async flush() {
    while (this.acked < this.length && !this.failed) {
      this.kick();
      await this.sending;
    }
    if (this.failed) throw new Refused(this.failed);
  }

  /**
   * Tells the space of a checkpoint written to it (`kappa`: "blake3:…"): the session's last
   * snapshot is that one, what a reclaim goes back to. Told in order, before the session is
   * given back; a refusal other than fencing is passed to `onWarning`.
   */
  checkpointed(kappa, onWarning) {
    this.told = this.told.then(async () => {
      if (this.failed) return;
      try {
        await spaceRequest(this.base, this.token, "POST", `/v1/sessions/${encodeURIComponent(this.id)}/checkpointed`, JSON.stringify({ epoch: this.epoch, snapshot: kappa }), `the checkpoint of session ${this.id}`);
      } catch (e) {
        if (/\(409\)|answered 409/.test(e.message)) this.fail(e.message);
        else if (onWarning) onWarning(e.message);
      }
    });
    return this.told;
  }

  /**
   * Gives the session back. `outcome`: {snapshot: "blake3:…"} (suspended here, already
   * written to the space), {exit_code, files}, {trap, files} (`files`: [{guest, tree}],
   * already sent) or {refused: reason}. Returns the session's record.
   */
  async giveBack(outcome) {
    await this.told;
    if (outcome.refused === undefined) await this.flush();
    this.stop();
    const ended = outcome.exit_code !== undefined || outcome.trap !== undefined;
    const body = JSON.stringify({ epoch: this.epoch, ...outcome, ...(ended ? { log_len: this.length } : {}) });
    const r = await spaceRequest(this.base, this.token, "POST", `/v1/sessions/${encodeURIComponent(this.id)}/return`, body, `the return of session ${this.id}`);
    return r.json();
  }
}

/**
 * A checkpoint to pre-copy before taking session `id` over: while it runs on its space, the
 * space writes one (`POST …/checkpoint`; the guest goes on) and its κ is returned; null for a
 * session that does not run (its lend moves nothing new), or if the space would not.
 */
export async function precopyPoint(base, token, id) {
  base = base.replace(/\/+$/, "");
  const path = `/v1/sessions/${encodeURIComponent(id)}`;
  try {
    const s = await (await spaceRequest(base, token, "GET", path, undefined, `session ${id}`)).json();
    if (s.state !== "running") return null;
    const c = await (await spaceRequest(base, token, "POST", `${path}/checkpoint`, "{}", `a checkpoint of ${id}`)).json();
    return c.state === "running" ? c.snapshot ?? null : null;
  } catch {
    return null;
  }
}

/**
 * Pre-copy rounds before taking session `id` over, as a live migration does: each round has
 * the space checkpoint the running session and `fetch(κ)` fetch and keep that checkpoint's
 * closure (resolving to the bytes it fetched: only what changed since the round before; null
 * if it failed). Rounds go on while one fetches more than `stopBytes` and less than the one
 * before, at most `maxRounds`. Returns the rounds: [{snapshot, bytes, ms}].
 */
export async function precopy(base, token, id, fetch, { maxRounds = 4, stopBytes = 4 << 20 } = {}) {
  const rounds = [];
  while (rounds.length < maxRounds) {
    const k = await precopyPoint(base, token, id);
    if (!k) break;
    const t0 = performance.now();
    const bytes = await fetch(k);
    if (bytes === null) break;
    rounds.push({ snapshot: k, bytes, ms: Math.round(performance.now() - t0) });
    const before = rounds.at(-2);
    if (bytes <= stopBytes || (before && bytes >= before.bytes)) break;
  }
  return rounds;
}
