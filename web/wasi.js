// WASI preview 1 for a guest resumed in a JavaScript engine (a browser tab, or Node): the
// guest's mounts live in memory, written from the snapshot's trees; stdout and stderr go to
// the callbacks the host gives; clocks go on from the snapshot's virtual monotonic time.
// It follows ferry's own WASI (crates/wasi/src/calls.rs) call for call, errno for errno,
// so a guest sees the same answers here as on the engines that suspended it.

export const E = {
  SUCCESS: 0, BADF: 8, BUSY: 10, EXIST: 20, FAULT: 21, FBIG: 22, INVAL: 28, IO: 29, ISDIR: 31,
  LOOP: 32, NAMETOOLONG: 37, NOENT: 44, NOSYS: 52, NOTDIR: 54, NOTEMPTY: 55, NOTSOCK: 57,
  NOTSUP: 58, PERM: 63, ROFS: 69, SPIPE: 70, XDEV: 75, NOTCAPABLE: 76,
};

const FT = { UNKNOWN: 0, CHAR: 2, DIR: 3, FILE: 4, SYMLINK: 7 };
const FDFLAG_APPEND = 1;
const OFLAG_CREAT = 1, OFLAG_DIRECTORY = 2, OFLAG_EXCL = 4, OFLAG_TRUNC = 8;
const LOOKUP_FOLLOW = 1;
const R = {
  DATASYNC: 1n << 0n, READ: 1n << 1n, SEEK: 1n << 2n, SET_FLAGS: 1n << 3n, SYNC: 1n << 4n,
  TELL: 1n << 5n, WRITE: 1n << 6n, ADVISE: 1n << 7n, ALLOCATE: 1n << 8n,
  FILESTAT_GET: 1n << 21n, SET_SIZE: 1n << 22n, SET_TIMES: 1n << 23n, POLL: 1n << 27n,
  PATH_SET_SIZE: 1n << 19n,
};
const FILE_RIGHTS = R.DATASYNC | R.READ | R.SEEK | R.SET_FLAGS | R.SYNC | R.TELL | R.WRITE |
  R.ADVISE | R.ALLOCATE | R.FILESTAT_GET | R.SET_SIZE | R.SET_TIMES | R.POLL;
const DIR_RIGHTS = ((0xfffn << 9n) & ~R.PATH_SET_SIZE) | (0x7n << 24n) | R.SET_FLAGS | R.SYNC |
  R.DATASYNC | R.FILESTAT_GET | R.SET_TIMES;
const STDIO_RIGHTS = R.READ | R.WRITE | R.SET_FLAGS | R.FILESTAT_GET | R.POLL;
/** Fresh inode numbers start here (as in ferry's `inodes.rs`), above any restored one. */
const FRESH_INO = 2 ** 48;
const MAX_SYMLINKS = 40;

/** Thrown by `proc_exit`; the host catches it. */
export class Exit {
  constructor(code) {
    this.code = code;
  }
}

/** A host failure that stops the guest (not an errno the guest could handle). */
export class Fatal extends Error {}

/** Thrown by a call that blocks (a sleep) when a suspend is asked for: the guest unwinds from it. */
export class Unwind {}

class Errno {
  constructor(n) {
    this.n = n;
  }
}
const fail = (n) => {
  throw new Errno(n);
};

// ---- the in-memory file system ---------------------------------------------------------

export class FileNode {
  constructor(data, mtime) {
    this.type = "file";
    this.data = data; // Uint8Array; `size` bytes of it are the file
    this.size = data.length;
    this.exec = false;
    this.mtime = mtime;
    this.atime = mtime;
    this.ctime = mtime;
    this.nlink = 0;
    this.ino = null;
  }
  ensure(n) {
    if (n > this.data.length) {
      const grown = new Uint8Array(Math.max(n, this.data.length * 2, 4096));
      grown.set(this.data.subarray(0, this.size));
      this.data = grown;
    }
  }
  resize(n) {
    if (n > this.size) {
      this.ensure(n);
      this.data.fill(0, this.size, n);
    }
    this.size = n;
  }
}

export class DirNode {
  constructor(parent, mtime) {
    this.type = "dir";
    this.entries = new Map();
    this.parent = parent; // null for a mount's root
    this.mtime = mtime;
    this.atime = mtime;
    this.ctime = mtime;
    this.ino = null;
    this.removed = false;
  }
  get nlink() {
    let n = 2;
    for (const c of this.entries.values()) if (c.type === "dir") n++;
    return n;
  }
}

export class LinkNode {
  constructor(target, mtime) {
    this.type = "symlink";
    this.target = target;
    this.mtime = mtime;
    this.atime = mtime;
    this.ctime = mtime;
    this.nlink = 1;
    this.ino = null;
  }
}

/** Names compared as ferry sorts them: by their UTF-8 bytes (code point order). */
export function byName(a, b) {
  const x = [...a];
  const y = [...b];
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = x[i].codePointAt(0) - y[i].codePointAt(0);
    if (d !== 0) return d;
  }
  return x.length - y.length;
}

// ---- the guest's view -------------------------------------------------------------------

/**
 * One guest's WASI state. `opts`: args, env (list of [k, v]), mounts (list of {guestPath,
 * root: DirNode, readOnly, dev}), fds (Map fd → descriptor as `restoreFd` makes), monotonicNs
 * (the snapshot's virtual clock), sleepDeadlineNs, stdout(bytes), stderr(bytes), stdin
 * (Uint8Array or null: end of file), inodes (list of {mount, node, dev, ino} to show).
 */
export class Wasi {
  constructor(opts) {
    this.args = opts.args;
    this.env = opts.env;
    this.mounts = opts.mounts;
    this.fds = opts.fds;
    this.out = [opts.stdout, opts.stderr];
    this.stdin = opts.stdin ?? null;
    this.stdinAt = 0;
    this.sleepDeadline = opts.sleepDeadlineNs ?? null;
    this.rewinding = false;
    const now = hostMonotonicNs();
    this.monoOffset = BigInt(opts.monotonicNs) - now;
    this.realtime = opts.realtime ?? (() => BigInt(Date.now()) * 1000000n);
    this.memory = null; // set by the host once instantiated
    // Bytes shown on stdout and stderr so far (carried by snapshots), and, for a space
    // session whose output log a snapshot carries, the records written since the resume.
    this.shown = [opts.stdoutBytes ?? 0, opts.stderrBytes ?? 0];
    this.records = opts.recordOutput ? [] : null;
    // A cell (Int32Array over a SharedArrayBuffer) another thread sets to ask for a suspend.
    this.suspendCell = opts.suspendCell ?? null;
    // The deadline of a sleep the guest was suspended in (carried by the snapshot).
    this.suspendedSleep = null;
    // Files and directories the guest asked about (a stat), whose numbers snapshots keep.
    this.asked = new Set();
    this.nextIno = FRESH_INO;
    this.takenIno = new Set();
    for (const { node, ino } of opts.inodes ?? []) {
      node.ino = ino;
      this.takenIno.add(ino);
      this.asked.add(node);
    }
  }

  /** Whether a suspend has been asked for. */
  suspendAsked() {
    return this.suspendCell !== null && Atomics.load(this.suspendCell, 0) !== 0;
  }

  monotonicNs() {
    const t = hostMonotonicNs() + this.monoOffset;
    return t < 0n ? 0n : t;
  }

  ino(node) {
    if (node.ino === null) {
      while (this.takenIno.has(this.nextIno)) this.nextIno++;
      node.ino = this.nextIno++;
    }
    return node.ino;
  }

  view() {
    return new DataView(this.memory.buffer);
  }
  bytes(ptr, len) {
    const buf = this.memory.buffer;
    if (ptr + len > buf.byteLength) fail(E.FAULT);
    return new Uint8Array(buf, ptr, len);
  }
  str(ptr, len) {
    try {
      return new TextDecoder("utf-8", { fatal: true }).decode(this.bytes(ptr, len));
    } catch (e) {
      if (e instanceof Errno) throw e;
      fail(E.INVAL);
    }
  }
  put(ptr, bytes) {
    this.bytes(ptr, bytes.length).set(bytes);
  }
  u32(ptr) {
    if (ptr + 4 > this.memory.buffer.byteLength) fail(E.FAULT);
    return this.view().getUint32(ptr, true);
  }
  putU32(ptr, v) {
    if (ptr + 4 > this.memory.buffer.byteLength) fail(E.FAULT);
    this.view().setUint32(ptr, v, true);
  }
  putU64(ptr, v) {
    if (ptr + 8 > this.memory.buffer.byteLength) fail(E.FAULT);
    this.view().setBigUint64(ptr, BigInt(v), true);
  }
  iovecs(ptr, n) {
    const out = [];
    for (let i = 0; i < n; i++) out.push([this.u32(ptr + 8 * i), this.u32(ptr + 8 * i + 4)]);
    return out;
  }

  fd(n) {
    const f = this.fds.get(n);
    if (!f) fail(E.BADF);
    return f;
  }
  dirFd(n) {
    const f = this.fd(n);
    if (f.kind !== "dir" && f.kind !== "preopen") fail(E.NOTDIR);
    return f;
  }
  readOnly(mount) {
    return this.mounts[mount].readOnly;
  }

  /**
   * Resolves `rel` against directory fd `n` as ferry does: `..` may not climb above that
   * directory, a symlink may lead anywhere inside the mount (not out of it, nor to an
   * absolute path). Returns {mount, dir, name, node} (`node` undefined if absent; `name`
   * null when the path names the directory `dir` itself).
   */
  resolve(n, rel, follow) {
    if (rel.length > 4096) fail(E.NAMETOOLONG);
    if (rel.startsWith("/")) fail(E.NOTCAPABLE);
    if (rel.includes("\0")) fail(E.INVAL);
    const f = this.dirFd(n);
    if (f.node.removed) fail(E.NOENT);
    // As ferry joins paths: lexically first, so `..` never climbs above the descriptor.
    const todo = [];
    for (const s of rel.split("/")) {
      if (s === "" || s === ".") continue;
      if (s === "..") {
        if (todo.length === 0) fail(E.NOTCAPABLE);
        todo.pop();
      } else todo.push(s);
    }
    const trailing = rel.endsWith("/");
    const stack = [];
    for (let d = f.node; d; d = d.parent) stack.unshift(d);
    let links = 0;
    while (todo.length > 0) {
      const seg = todo.shift();
      const top = stack[stack.length - 1];
      if (seg === "" || seg === ".") continue;
      if (seg === "..") {
        // Only from a link's target, which may lead anywhere in the mount but not out.
        if (stack.length <= 1) fail(E.NOTCAPABLE);
        stack.pop();
        continue;
      }
      const child = top.entries.get(seg);
      const last = todo.length === 0;
      if (child && child.type === "symlink" && (!last || follow || trailing)) {
        if (++links > MAX_SYMLINKS) fail(E.LOOP);
        if (child.target.startsWith("/")) fail(E.NOTCAPABLE);
        todo.unshift(...child.target.split("/"));
        continue;
      }
      if (last) {
        if (trailing && child && child.type !== "dir") fail(E.NOTDIR);
        return { mount: f.mount, dir: top, name: seg, node: child };
      }
      if (!child) fail(E.NOENT);
      if (child.type !== "dir") fail(E.NOTDIR);
      stack.push(child);
    }
    // The path names a directory itself: as its name in its parent (null: the mount's root).
    const node = stack[stack.length - 1];
    if (!node.parent) return { mount: f.mount, dir: node, name: null, node };
    let name = null;
    for (const [k, c] of node.parent.entries) if (c === node) name = k;
    return { mount: f.mount, dir: node.parent, name, node };
  }

  pathArg(n, ptr, len, follow) {
    return this.resolve(n, this.str(ptr, len), follow);
  }

  filestat(ptr, node, mount) {
    this.asked.add(node);
    const b = new DataView(new ArrayBuffer(64));
    b.setBigUint64(0, BigInt(this.mounts[mount].dev), true);
    b.setBigUint64(8, BigInt(this.ino(node)), true);
    b.setUint8(16, node.type === "dir" ? FT.DIR : node.type === "symlink" ? FT.SYMLINK : FT.FILE);
    b.setBigUint64(24, BigInt(node.nlink), true);
    const size = node.type === "file" ? node.size : node.type === "dir" ? 4096 : new TextEncoder().encode(node.target).length;
    b.setBigUint64(32, BigInt(size), true);
    b.setBigUint64(40, clampNs(node.atime), true);
    b.setBigUint64(48, clampNs(node.mtime), true);
    b.setBigUint64(56, clampNs(node.ctime), true);
    this.put(ptr, new Uint8Array(b.buffer));
  }

  nextFd() {
    let n = 3;
    while (this.fds.has(n)) n++;
    return n;
  }

  /** The WASI functions, named as the module imports them. */
  imports(host) {
    const w = this;
    const call = (name, fn) => (...args) => {
      host.beforeCall(name);
      try {
        const r = fn(...args);
        return r === undefined ? E.SUCCESS : r;
      } catch (e) {
        if (e instanceof Errno) return e.n;
        if (e instanceof Unwind) {
          host.startUnwind();
          return 0;
        }
        throw e;
      }
    };
    const N = Number;
    const table = {
      args_get: (ptrs, buf) => w.stringsGet(ptrs, buf, false),
      args_sizes_get: (c, s) => w.stringsSizes(c, s, false),
      environ_get: (ptrs, buf) => w.stringsGet(ptrs, buf, true),
      environ_sizes_get: (c, s) => w.stringsSizes(c, s, true),
      clock_res_get: (id, out) => {
        if (id > 3) return E.INVAL;
        w.putU64(out, 1n);
      },
      clock_time_get: (id, _precision, out) => {
        if (id === 0) w.putU64(out, w.realtime());
        else if (id <= 3) w.putU64(out, w.monotonicNs());
        else return E.INVAL;
      },
      fd_advise: (fd, _o, _l, advice) => {
        const f = w.fd(fd);
        if (f.kind === "file") return advice <= 5 ? E.SUCCESS : E.INVAL;
        return f.kind === "dir" || f.kind === "preopen" ? E.ISDIR : E.BADF;
      },
      fd_allocate: (fd, offset, len) => {
        const f = w.fd(fd);
        if (f.kind === "dir" || f.kind === "preopen") return E.ISDIR;
        if (f.kind !== "file" || !f.write) return E.BADF;
        const end = N(offset + len);
        if (end > 2 ** 40) return E.FBIG;
        if (f.node.size < end) {
          f.node.resize(end);
          w.touch(f.node);
        }
      },
      fd_close: (fd) => {
        w.fd(fd);
        w.fds.delete(fd);
      },
      fd_datasync: (fd) => void w.fd(fd),
      fd_sync: (fd) => void w.fd(fd),
      fd_fdstat_get: (fd, out) => w.fdstat(fd, out),
      fd_fdstat_set_flags: (fd, flags) => {
        w.fd(fd).fdflags = flags;
      },
      fd_fdstat_set_rights: (fd) => {
        w.fd(fd);
        return E.NOTSUP;
      },
      fd_filestat_get: (fd, out) => {
        const f = w.fd(fd);
        if (f.kind === "file" || f.kind === "dir" || f.kind === "preopen") {
          w.filestat(out, f.node, f.mount);
        } else {
          const b = new Uint8Array(64);
          b[16] = FT.CHAR;
          w.put(out, b);
        }
      },
      fd_filestat_set_size: (fd, size) => {
        const f = w.fd(fd);
        if (!f.write || f.kind !== "file") return E.BADF;
        f.node.resize(N(size));
        w.touch(f.node);
      },
      fd_filestat_set_times: (fd, atim, mtim, flags) => {
        const f = w.fd(fd);
        if (f.kind !== "file" && f.kind !== "dir" && f.kind !== "preopen") return E.BADF;
        return w.setTimes(f.node, atim, mtim, flags);
      },
      fd_pread: (fd, iovs, n, offset, out) => w.rw(fd, iovs, n, offset, out, false),
      fd_pwrite: (fd, iovs, n, offset, out) => w.rw(fd, iovs, n, offset, out, true),
      fd_read: (fd, iovs, n, out) => w.rw(fd, iovs, n, null, out, false),
      fd_write: (fd, iovs, n, out) => w.rw(fd, iovs, n, null, out, true),
      fd_prestat_get: (fd, out) => {
        const f = w.fd(fd);
        if (f.kind !== "preopen") return E.BADF;
        const name = new TextEncoder().encode(w.mounts[f.mount].guestPath);
        w.put(out, new Uint8Array(8));
        w.putU32(out + 4, name.length);
      },
      fd_prestat_dir_name: (fd, ptr, len) => {
        const f = w.fd(fd);
        if (f.kind !== "preopen") return E.BADF;
        const name = new TextEncoder().encode(w.mounts[f.mount].guestPath);
        if (len < name.length) return E.NAMETOOLONG;
        w.put(ptr, name);
      },
      fd_readdir: (fd, buf, len, cookie, out) => w.readdir(fd, buf, len, N(cookie), out),
      fd_renumber: (from, to) => {
        const f = w.fd(from);
        w.fd(to);
        w.fds.set(to, f);
        w.fds.delete(from);
      },
      fd_seek: (fd, offset, whence, out) => w.seek(fd, offset, whence, out),
      fd_tell: (fd, out) => w.seek(fd, 0n, 1, out),
      path_create_directory: (fd, p, l) => w.pathOp(fd, p, l, "mkdir"),
      path_remove_directory: (fd, p, l) => w.pathOp(fd, p, l, "rmdir"),
      path_unlink_file: (fd, p, l) => w.pathOp(fd, p, l, "unlink"),
      path_filestat_get: (fd, flags, p, l, out) => {
        const r = w.pathArg(fd, p, l, (flags & LOOKUP_FOLLOW) !== 0);
        if (!r.node) return E.NOENT;
        w.filestat(out, r.node, r.mount);
      },
      path_filestat_set_times: (fd, flags, p, l, atim, mtim, fl) => {
        const r = w.pathArg(fd, p, l, (flags & LOOKUP_FOLLOW) !== 0);
        if (!r.node) return E.NOENT;
        return w.setTimes(r.node, atim, mtim, fl);
      },
      path_open: (fd, dirflags, p, l, oflags, rights, _inh, fdflags, out) =>
        w.open(fd, dirflags, p, l, oflags, rights, fdflags, out),
      path_readlink: (fd, p, l, buf, bufLen, out) => {
        const r = w.pathArg(fd, p, l, false);
        if (!r.node) return E.NOENT;
        if (r.node.type !== "symlink") return E.INVAL;
        const t = new TextEncoder().encode(r.node.target);
        const n = Math.min(t.length, bufLen);
        w.put(buf, t.subarray(0, n));
        w.putU32(out, n);
      },
      path_rename: (fd, p, l, fd2, p2, l2) => w.rename(fd, p, l, fd2, p2, l2),
      path_link: (fd, flags, p, l, fd2, p2, l2) => w.link(fd, flags, p, l, fd2, p2, l2),
      path_symlink: (tp, tl, fd, p, l) => w.symlink(tp, tl, fd, p, l),
      poll_oneoff: (subs, events, n, out) => w.poll(subs, events, n, out),
      proc_exit: (code) => {
        throw new Exit(code | 0);
      },
      proc_raise: () => E.NOTSUP,
      sched_yield: () => E.SUCCESS,
      random_get: (ptr, len) => {
        const b = w.bytes(ptr, len);
        for (let at = 0; at < len; at += 65536) {
          crypto.getRandomValues(b.subarray(at, Math.min(len, at + 65536)));
        }
      },
      sock_accept: (fd) => (w.fd(fd), E.NOTSOCK),
      sock_recv: (fd) => (w.fd(fd), E.NOTSOCK),
      sock_send: (fd) => (w.fd(fd), E.NOTSOCK),
      sock_shutdown: (fd) => (w.fd(fd), E.NOTSOCK),
    };
    const out = {};
    for (const [name, fn] of Object.entries(table)) out[name] = call(name, fn);
    return out;
  }

  strings(env) {
    const enc = new TextEncoder();
    return (env ? this.env.map(([k, v]) => `${k}=${v}`) : this.args).map((s) => enc.encode(`${s}\0`));
  }
  stringsSizes(countPtr, sizePtr, env) {
    const s = this.strings(env);
    this.putU32(countPtr, s.length);
    this.putU32(sizePtr, s.reduce((a, b) => a + b.length, 0));
  }
  stringsGet(ptrs, buf, env) {
    let at = buf;
    this.strings(env).forEach((s, i) => {
      this.putU32(ptrs + 4 * i, at);
      this.put(at, s);
      at += s.length;
    });
  }

  fdstat(fd, out) {
    const f = this.fd(fd);
    const stdio = f.kind === "stdin" || f.kind === "stdout" || f.kind === "stderr";
    const ft = stdio ? FT.CHAR : f.kind === "file" ? FT.FILE : FT.DIR;
    // Not a terminal: a stream that may be a file or a pipe (isatty is false).
    let [rights, inheriting] = stdio
      ? [STDIO_RIGHTS | R.SEEK | R.TELL, 0n]
      : f.kind === "file"
        ? [FILE_RIGHTS, 0n]
        : [DIR_RIGHTS, DIR_RIGHTS | FILE_RIGHTS];
    if (!f.read || f.kind === "stdout" || f.kind === "stderr") rights &= ~R.READ;
    if (!f.write || f.kind === "stdin") rights &= ~R.WRITE;
    const b = new DataView(new ArrayBuffer(24));
    b.setUint8(0, ft);
    b.setUint16(2, f.fdflags, true);
    b.setBigUint64(8, rights, true);
    b.setBigUint64(16, inheriting, true);
    this.put(out, new Uint8Array(b.buffer));
  }

  touch(node) {
    node.mtime = this.realtime();
    node.ctime = node.mtime;
  }

  setTimes(node, atim, mtim, flags) {
    if ((flags & 3) === 3 || (flags & 12) === 12 || (flags & ~0xf) !== 0) return E.INVAL;
    const now = this.realtime();
    if (flags & 1) node.atime = atim;
    else if (flags & 2) node.atime = now;
    if (flags & 4) node.mtime = mtim;
    else if (flags & 8) node.mtime = now;
    node.ctime = now;
  }

  rw(fd, iovs, n, at, out, write) {
    const vecs = this.iovecs(iovs, n);
    const f = this.fd(fd);
    let total = 0;
    if (f.kind === "stdout" || f.kind === "stderr") {
      if (!write) return E.BADF;
      const i = f.kind === "stderr" ? 1 : 0;
      for (const [p, len] of vecs) {
        // A copy: the sink may keep it past the next write into this memory.
        const bytes = this.bytes(p, len).slice();
        this.out[i](bytes);
        if (this.records && len > 0) this.records.push([i + 1, bytes]);
        total += len;
      }
      this.shown[i] += total;
    } else if (f.kind === "stdin") {
      if (write) return E.BADF;
      this.rewinding = false;
      for (const [p, len] of vecs) {
        const data = this.stdin ?? new Uint8Array(0);
        const k = Math.min(len, data.length - this.stdinAt);
        if (k <= 0) break;
        this.put(p, data.subarray(this.stdinAt, this.stdinAt + k));
        this.stdinAt += k;
        total += k;
        if (k < len) break;
      }
    } else if (f.kind === "file") {
      if (write ? !f.write : !f.read) return E.BADF;
      const node = f.node;
      let pos = at === null ? (write && f.fdflags & FDFLAG_APPEND ? node.size : f.offset) : Number(at);
      for (const [p, len] of vecs) {
        if (write) {
          node.ensure(pos + len);
          if (pos > node.size) node.data.fill(0, node.size, pos);
          node.data.set(this.bytes(p, len), pos);
          node.size = Math.max(node.size, pos + len);
          pos += len;
          total += len;
        } else {
          const k = Math.max(0, Math.min(len, node.size - pos));
          this.put(p, node.data.subarray(pos, pos + k));
          pos += k;
          total += k;
          if (k < len) break;
        }
      }
      if (write && total > 0) this.touch(node);
      if (at === null) f.offset = pos;
    } else {
      return write ? E.BADF : E.ISDIR;
    }
    this.putU32(out, total);
  }

  seek(fd, offset, whence, out) {
    const f = this.fd(fd);
    if (f.kind === "dir" || f.kind === "preopen") return E.BADF;
    if (f.kind !== "file") return E.SPIPE;
    const base = whence === 0 ? 0n : whence === 1 ? BigInt(f.offset) : whence === 2 ? BigInt(f.node.size) : null;
    if (base === null) return E.INVAL;
    const to = base + BigInt.asIntN(64, offset);
    if (to < 0n) return E.INVAL;
    f.offset = Number(to);
    this.putU64(out, to);
  }

  open(fd, dirflags, p, l, oflags, rights, fdflags, out) {
    const follow = (dirflags & LOOKUP_FOLLOW) !== 0;
    const r = this.pathArg(fd, p, l, follow);
    const wantsWrite = (rights & R.WRITE) !== 0n || (oflags & (OFLAG_CREAT | OFLAG_TRUNC)) !== 0 ||
      (fdflags & FDFLAG_APPEND) !== 0;
    let node = r.node;
    if (node && node.type === "symlink") {
      // Not followed (no LOOKUP_FOLLOW): not a directory; as O_NOFOLLOW, opening it fails.
      return (oflags & OFLAG_DIRECTORY) !== 0 ? E.NOTDIR : E.LOOP;
    }
    if ((oflags & OFLAG_DIRECTORY) !== 0 || (node && node.type === "dir")) {
      if (!node) return E.NOENT;
      if (node.type !== "dir") return E.NOTDIR;
      if ((oflags & (OFLAG_CREAT | OFLAG_EXCL)) === (OFLAG_CREAT | OFLAG_EXCL)) return E.EXIST;
      if (wantsWrite) return E.ISDIR;
      const n = this.nextFd();
      this.fds.set(n, { kind: "dir", mount: r.mount, node, offset: 0, fdflags: 0, read: true, write: false });
      this.putU32(out, n);
      return;
    }
    if (wantsWrite && this.readOnly(r.mount)) return E.ROFS;
    if (node && (oflags & (OFLAG_CREAT | OFLAG_EXCL)) === (OFLAG_CREAT | OFLAG_EXCL)) return E.EXIST;
    if (!node) {
      if ((oflags & OFLAG_CREAT) === 0) return E.NOENT;
      if (r.name === null) return E.ISDIR;
      node = new FileNode(new Uint8Array(0), this.realtime());
      node.nlink = 1;
      r.dir.entries.set(r.name, node);
      this.touch(r.dir);
    } else if ((oflags & OFLAG_TRUNC) !== 0) {
      node.resize(0);
      this.touch(node);
    }
    const n = this.nextFd();
    this.fds.set(n, {
      kind: "file",
      mount: r.mount,
      node,
      offset: 0,
      fdflags,
      read: (rights & R.READ) !== 0n || !wantsWrite,
      write: wantsWrite,
    });
    this.putU32(out, n);
  }

  pathOp(fd, p, l, op) {
    const r = this.pathArg(fd, p, l, false);
    if (this.readOnly(r.mount)) return E.ROFS;
    if (r.name === null) return E.PERM;
    const node = r.node;
    if (op === "mkdir") {
      if (node) return E.EXIST;
      r.dir.entries.set(r.name, new DirNode(r.dir, this.realtime()));
      this.touch(r.dir);
      return;
    }
    if (!node) return E.NOENT;
    if (op === "rmdir") {
      if (node.type !== "dir") return E.NOTDIR;
      if (node.entries.size > 0) return E.NOTEMPTY;
      node.removed = true;
    } else {
      if (node.type === "dir") return E.ISDIR;
      node.nlink--;
    }
    r.dir.entries.delete(r.name);
    this.touch(r.dir);
  }

  rename(fd, p, l, fd2, p2, l2) {
    const a = this.pathArg(fd, p, l, false);
    const b = this.pathArg(fd2, p2, l2, false);
    if (this.readOnly(a.mount) || this.readOnly(b.mount)) return E.ROFS;
    if (a.name === null || b.name === null) return E.BUSY;
    if (!a.node) return E.NOENT;
    if (a.mount !== b.mount) return E.XDEV;
    if (a.node === b.node) return;
    if (b.node) {
      if (a.node.type === "dir" && b.node.type !== "dir") return E.NOTDIR;
      if (a.node.type !== "dir" && b.node.type === "dir") return E.ISDIR;
      if (b.node.type === "dir" && b.node.entries.size > 0) return E.NOTEMPTY;
    }
    if (a.node.type === "dir") {
      for (let d = b.dir; d; d = d.parent) if (d === a.node) return E.INVAL;
    }
    if (b.node) {
      if (b.node.type === "dir") b.node.removed = true;
      else b.node.nlink--;
    }
    a.dir.entries.delete(a.name);
    b.dir.entries.set(b.name, a.node);
    if (a.node.type === "dir") a.node.parent = b.dir;
    a.node.ctime = this.realtime();
    this.touch(a.dir);
    this.touch(b.dir);
  }

  link(fd, flags, p, l, fd2, p2, l2) {
    const a = this.pathArg(fd, p, l, (flags & LOOKUP_FOLLOW) !== 0);
    const name2 = this.str(p2, l2);
    const b = this.resolve(fd2, name2, false);
    if (this.readOnly(a.mount) || this.readOnly(b.mount)) return E.ROFS;
    if (!a.node) return E.NOENT;
    if (a.node.type === "dir") return E.PERM;
    if (name2.endsWith("/")) return b.node ? E.EXIST : E.NOENT;
    if (b.node || b.name === null) return E.EXIST;
    if (a.mount !== b.mount) return E.XDEV;
    b.dir.entries.set(b.name, a.node);
    a.node.nlink++;
    a.node.ctime = this.realtime();
    this.touch(b.dir);
  }

  symlink(tp, tl, fd, p, l) {
    const target = this.str(tp, tl);
    const name = this.str(p, l);
    const r = this.resolve(fd, name, false);
    if (this.readOnly(r.mount)) return E.ROFS;
    if (target === "" || target.includes("\0")) return E.NOENT;
    if (target.startsWith("/")) return E.PERM;
    // The target must stay inside the mount, resolved from the link's directory.
    let depth = 0;
    for (let d = r.dir; d.parent; d = d.parent) depth++;
    for (const seg of target.split("/")) {
      if (seg === "..") {
        if (--depth < 0) return E.NOTCAPABLE;
      } else if (seg !== "" && seg !== ".") depth++;
    }
    if (name.endsWith("/")) return r.node ? E.EXIST : E.NOENT;
    if (r.node || r.name === null) return E.EXIST;
    r.dir.entries.set(r.name, new LinkNode(target, this.realtime()));
    this.touch(r.dir);
  }

  readdir(fd, buf, len, cookie, out) {
    const f = this.dirFd(fd);
    const dir = f.node;
    if (dir.removed) return E.NOENT;
    const names = [
      [".", FT.DIR, dir],
      ["..", FT.DIR, dir.parent ?? dir],
    ];
    const rest = [...dir.entries.keys()].sort(byName);
    for (const name of rest) {
      const c = dir.entries.get(name);
      names.push([name, c.type === "dir" ? FT.DIR : c.type === "symlink" ? FT.SYMLINK : FT.FILE, c]);
    }
    const enc = new TextEncoder();
    const parts = [];
    let size = 0;
    for (let i = cookie; i < names.length && size < len; i++) {
      const [name, ty, node] = names[i];
      const nb = enc.encode(name);
      const d = new DataView(new ArrayBuffer(24 + nb.length));
      d.setBigUint64(0, BigInt(i + 1), true);
      d.setBigUint64(8, BigInt(this.ino(node)), true);
      d.setUint32(16, nb.length, true);
      d.setUint8(20, ty);
      const bytes = new Uint8Array(d.buffer);
      bytes.set(nb, 24);
      parts.push(bytes);
      size += bytes.length;
    }
    const all = new Uint8Array(size);
    let at = 0;
    for (const b of parts) {
      all.set(b, at);
      at += b.length;
    }
    const n = Math.min(size, len);
    this.put(buf, all.subarray(0, n));
    this.putU32(out, n);
  }

  poll(subs, events, n, out) {
    if (n === 0 || n > 256) return E.INVAL;
    const v = this.view();
    if (subs + 48 * n > v.byteLength || events + 32 * n > v.byteLength) return E.FAULT;
    const now = this.monotonicNs();
    let deadline = null;
    const ready = [];
    for (let i = 0; i < n; i++) {
      const s = subs + 48 * i;
      const userdata = v.getBigUint64(s, true);
      const tag = v.getUint8(s + 8);
      if (tag === 0) {
        const clock = v.getUint32(s + 16, true);
        const timeout = v.getBigUint64(s + 24, true);
        const flags = v.getUint16(s + 40, true);
        let d;
        if (flags & 1) {
          if (clock === 0) {
            const real = this.realtime();
            d = now + (timeout > real ? timeout - real : 0n);
          } else d = timeout;
        } else d = now + timeout;
        if (deadline === null || d < deadline[0]) deadline = [d, userdata];
      } else if (tag === 1 || tag === 2) {
        ready.push([userdata, tag]);
      } else return E.INVAL;
    }
    if (ready.length === 0 && deadline !== null) {
      let d = deadline[0];
      if (this.rewinding && this.sleepDeadline !== null) d = BigInt(this.sleepDeadline);
      this.sleepDeadline = null;
      this.rewinding = false;
      sleepUntil(() => this.monotonicNs() >= d || this.suspendAsked(), () => Number(d - this.monotonicNs()), this.suspendCell);
      if (this.monotonicNs() < d) {
        // Suspended in the sleep: the resumed guest sleeps on to the same deadline.
        this.suspendedSleep = d;
        throw new Unwind();
      }
      ready.push([deadline[1], 0]);
    }
    this.rewinding = false;
    const w = this.view();
    ready.forEach(([userdata, tag], i) => {
      const e = events + 32 * i;
      for (let k = 0; k < 32; k++) w.setUint8(e + k, 0);
      w.setBigUint64(e, userdata, true);
      w.setUint8(e + 10, tag);
    });
    this.putU32(out, ready.length);
  }
}

function clampNs(t) {
  const x = BigInt(t);
  return x < 0n ? 0n : x;
}

const origin = typeof performance !== "undefined" ? performance.timeOrigin : Date.now();
function hostMonotonicNs() {
  if (typeof process !== "undefined" && process.hrtime?.bigint) return process.hrtime.bigint();
  return BigInt(Math.round((origin + performance.now()) * 1e6));
}

let waitCell = null;
/**
 * Blocks until `done()`: with Atomics.wait where the engine allows it (on `cell`, so a
 * suspend asked for wakes it), else by spinning.
 */
function sleepUntil(done, nsLeft, cell) {
  if (waitCell === null && typeof SharedArrayBuffer !== "undefined") {
    try {
      waitCell = new Int32Array(new SharedArrayBuffer(4));
      Atomics.wait(waitCell, 0, 0, 0);
    } catch {
      waitCell = false;
    }
  }
  while (!done()) {
    const ms = Math.max(0, Math.min(50, nsLeft() / 1e6));
    if (cell && waitCell) Atomics.wait(cell, 0, 0, ms);
    else if (waitCell) Atomics.wait(waitCell, 0, 0, ms);
  }
}
