//! Connections to peers that notice when the peer goes silent.
//!
//! A peer that dies without closing its connections (a machine powered off, a cable pulled,
//! a network partition) sends no reset: a request to it would wait for the kernel's own
//! retransmission timeout, about 15 minutes on Linux — a migration's paused guest with it.
//! Every connection ferry opens to a space, and every connection a space accepts, therefore
//! has TCP keep-alive probes and `TCP_USER_TIMEOUT` set so that a silent peer is given up
//! after [`peer_silence`] (15 s; `FERRY_PEER_SILENCE_MS`). A live peer's kernel answers the
//! probes while its process works, so a long request (a prepare restoring a big snapshot, a
//! long poll) is never cut for being slow.
//!
//! A peer whose machine lives but whose process hangs (stopped, frozen, swapped out) goes on
//! answering probes and acknowledging data until its buffers fill. Once its window has stayed
//! shut for the silence while there is data to send, the kernel gives the connection up
//! (`TCP_USER_TIMEOUT` covers a zero window since Linux 5.11): that is what bounds a space's
//! writes to a client that stops reading. ferry bounds its clients' writes itself as well (a
//! write the peer takes nothing of for the silence fails, whatever the kernel). What no kernel
//! sees is a peer that has all it was sent and never answers: on connections made for calls
//! that expect the peer's answer soon ([`PeerConnector::answering`]: store calls, a
//! migration's steps, session records, etcd), a read that gets nothing for [`peer_stall`]
//! fails — a prepare, which may work for long, sends a byte every [`PROGRESS_EVERY`] while it
//! works — and a long poll (`wait`, `logs`) is given up the stall after the wait it asked for.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, ShutdownHandle, Transport,
};

/// The default of [`peer_silence`].
const DEFAULT_SILENCE: Duration = Duration::from_secs(15);

/// How long a connection may go without any sign of life from its peer (no answer to
/// keep-alive probes, or sent data unacknowledged) before it is given up:
/// `FERRY_PEER_SILENCE_MS`, else 15 s. Read once per process (every connection asks). The
/// `ferry` command refuses a value that does not parse or is under 1000 before it gets here;
/// a library user's bad value is ignored (the default holds).
pub fn peer_silence() -> Duration {
    static SILENCE: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SILENCE.get_or_init(|| {
        std::env::var("FERRY_PEER_SILENCE_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&ms| ms >= 1000)
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_SILENCE)
    })
}

/// How long a peer's process may go without sending a byte while a call that expects its
/// answer soon waits: twice [`peer_silence`] (30 s by default).
pub fn peer_stall() -> Duration {
    peer_silence() * 2
}

/// How often a space sends a byte of progress while it works on a request that asked for it
/// (`Ferry-Progress`: a migration's prepare), so that the waiting peer can tell a slow answer
/// from a hung process.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// Sets keep-alive probes and `TCP_USER_TIMEOUT` on `s` so that a peer silent for `silence`
/// is given up: the first probe after a third of it idle, then four more, a sixth apart.
pub fn watch_peer(s: socket2::SockRef<'_>, silence: Duration) -> io::Result<()> {
    let second = Duration::from_secs(1);
    let probes = socket2::TcpKeepalive::new()
        .with_time((silence / 3).max(second))
        .with_interval((silence / 6).max(second))
        .with_retries(4);
    s.set_tcp_keepalive(&probes)?;
    s.set_tcp_user_timeout(Some(silence))
}

/// [`watch_peer`] with [`peer_silence`] on a connection a space accepted; one whose socket
/// refuses the options is served anyway, with a warning.
pub(crate) fn watch_accepted(s: socket2::SockRef<'_>) {
    if let Err(e) = watch_peer(s, peer_silence()) {
        tracing::warn!(error = %e, "could not set keep-alive on a connection");
    }
}

/// Connects plain TCP like ureq's own connector, then watches the peer ([`watch_peer`]).
/// Every write is bounded by [`peer_silence`] (a peer that takes no byte for that long is
/// given up); reads by [`peer_stall`] too when made [`PeerConnector::answering`].
#[derive(Debug)]
pub(crate) struct PeerConnector {
    /// How long one read may get nothing (`None`: as long as the request allows).
    read_stall: Option<Duration>,
    /// How long one write may hand the kernel nothing.
    write_stall: Duration,
}

impl Default for PeerConnector {
    fn default() -> Self {
        Self {
            read_stall: None,
            write_stall: peer_silence(),
        }
    }
}

impl PeerConnector {
    /// A connector for calls whose answer is due soon: a read that gets nothing for
    /// [`peer_stall`] fails (the peer's process is taken to have hung).
    pub(crate) fn answering() -> Self {
        Self {
            read_stall: Some(peer_stall()),
            ..Self::default()
        }
    }
}

impl<In: Transport> Connector<In> for PeerConnector {
    type Out = PeerTransport;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<In>,
    ) -> Result<Option<Self::Out>, ureq::Error> {
        let silence = peer_silence();
        let mut last = None;
        for addr in details.addrs.iter() {
            let r = match details.timeout.not_zero() {
                Some(t) => TcpStream::connect_timeout(addr, *t),
                None => TcpStream::connect(addr),
            };
            match r {
                Ok(stream) => {
                    if details.config.no_delay() {
                        stream.set_nodelay(true)?;
                    }
                    watch_peer(socket2::SockRef::from(&stream), silence)?;
                    let buffers = LazyBuffers::new(
                        details.config.input_buffer_size(),
                        details.config.output_buffer_size(),
                    );
                    let t = PeerTransport {
                        stream: Arc::new(Stream(stream)),
                        buffers,
                        read_timeout: None,
                        write_timeout: None,
                        read_stall: self.read_stall,
                        write_stall: self.write_stall,
                    };
                    let handle: Arc<dyn ShutdownHandle> = t.stream.clone();
                    (details.register_shutdown)(Arc::downgrade(&handle))?;
                    return Ok(Some(t));
                }
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    last = Some(ureq::Error::Timeout(ureq::Timeout::Connect));
                }
                Err(e) => last = Some(e.into()),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::ConnectionRefused, "no address to connect to").into()
        }))
    }
}

/// The socket, shared with the agent's shutdown handle.
struct Stream(TcpStream);

impl ShutdownHandle for Stream {
    fn shutdown(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

/// A plain TCP connection made by [`PeerConnector`].
pub(crate) struct PeerTransport {
    stream: Arc<Stream>,
    buffers: LazyBuffers,
    /// The socket's read and write timeouts as last set (`None`: never set), so that a
    /// transfer's many reads and writes set them only when they change.
    read_timeout: Option<Option<Duration>>,
    write_timeout: Option<Option<Duration>>,
    /// How long one read may get nothing, when bounded ([`PeerConnector::answering`]).
    read_stall: Option<Duration>,
    /// How long one write may hand the kernel nothing ([`peer_silence`]).
    write_stall: Duration,
}

/// One read's or write's socket timeout: the request's own (ureq's, `None` when it has none)
/// or the stall bound, whichever is shorter — and whether it is the stall bound.
fn bound(request: Option<Duration>, stall: Option<Duration>) -> (Option<Duration>, bool) {
    match (request, stall) {
        (Some(r), Some(s)) if s < r => (Some(s), true),
        (None, Some(s)) => (Some(s), true),
        (r, _) => (r, false),
    }
}

/// Sets a socket timeout through `set` unless it is already `want`.
fn set_timeout(
    last: &mut Option<Option<Duration>>,
    want: Option<Duration>,
    set: impl FnOnce(Option<Duration>) -> io::Result<()>,
) -> io::Result<()> {
    if *last != Some(want) {
        set(want)?;
        *last = Some(want);
    }
    Ok(())
}

impl fmt::Debug for PeerTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerTransport")
            .field("peer", &self.stream.0.peer_addr().ok())
            .finish()
    }
}

/// What a read or write that hit its stall bound says, with that bound.
#[derive(Debug, Clone, Copy)]
enum Stalled {
    Read(Duration),
    Write(Duration),
}

/// An I/O error: a read or write past its stall bound reported as a peer that stopped
/// answering or reading; one past the request's own timeout (the socket's, `EAGAIN`) as that
/// timeout; the kernel giving the connection up (`ETIMEDOUT`: probes unanswered, data
/// unacknowledged) as a silent peer.
fn io_error(e: io::Error, timeout: &NextTimeout, stalled: Option<Stalled>) -> ureq::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock => match stalled {
            Some(Stalled::Read(d)) => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the peer stopped answering: nothing came for {} s while its machine still \
                     answered (its process hung or stopped?)",
                    d.as_secs()
                ),
            )
            .into(),
            Some(Stalled::Write(d)) => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the peer stopped reading: it took nothing for {} s while its machine still \
                     answered (its process hung or stopped?)",
                    d.as_secs()
                ),
            )
            .into(),
            None => ureq::Error::Timeout(timeout.reason),
        },
        io::ErrorKind::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the peer went silent: no sign of life for {} s (FERRY_PEER_SILENCE_MS)",
                peer_silence().as_secs()
            ),
        )
        .into(),
        _ => e.into(),
    }
}

impl Transport for PeerTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        let timeout = timeout.for_write();
        if timeout.after.is_zero() {
            return Err(ureq::Error::Timeout(timeout.reason));
        }
        let s = &self.stream.0;
        let (t, stall) = bound(timeout.not_zero().map(|t| *t), Some(self.write_stall));
        set_timeout(&mut self.write_timeout, t, |t| s.set_write_timeout(t))?;
        let stalled = stall.then_some(Stalled::Write(self.write_stall));
        let out = &self.buffers.output()[..amount];
        (&self.stream.0)
            .write_all(out)
            .map_err(|e| io_error(e, &timeout, stalled))
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        let timeout = timeout.for_read();
        if timeout.after.is_zero() {
            return Err(ureq::Error::Timeout(timeout.reason));
        }
        let s = &self.stream.0;
        let (t, stall) = bound(timeout.not_zero().map(|t| *t), self.read_stall);
        set_timeout(&mut self.read_timeout, t, |t| s.set_read_timeout(t))?;
        let stalled = self.read_stall.filter(|_| stall).map(Stalled::Read);
        let input = self.buffers.input_append_buf();
        let n = loop {
            match (&self.stream.0).read(input) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r.map_err(|e| io_error(e, &timeout, stalled))?,
            }
        };
        self.buffers.input_appended(n);
        Ok(n > 0)
    }

    fn is_open(&mut self) -> bool {
        // A pooled connection is reused only if nothing is waiting on it (the peer sent
        // nothing unasked, and did not close it).
        let s = &self.stream.0;
        if s.set_nonblocking(true).is_err() {
            return false;
        }
        let mut one = [0u8];
        let open = matches!((&*s).read(&mut one), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        open && s.set_nonblocking(false).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent whose connections give a peer up after `read` without a byte, or `write`
    /// without taking one.
    fn stalling(read: Duration, write: Duration) -> ureq::Agent {
        crate::client::build_agent(
            crate::tls::client_config(),
            PeerConnector {
                read_stall: Some(read),
                write_stall: write,
            },
        )
    }

    /// A listener whose connections are accepted (the kernel does it) and never served.
    fn hung_peer() -> (std::net::TcpListener, String) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/", l.local_addr().unwrap());
        (l, url)
    }

    #[test]
    fn a_peer_that_sends_nothing_is_given_up_after_the_read_stall() {
        let (_l, url) = hung_peer();
        let t = std::time::Instant::now();
        let e = stalling(Duration::from_millis(300), Duration::from_secs(60))
            .get(&url)
            .call()
            .unwrap_err();
        assert!(e.to_string().contains("stopped answering"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn a_peer_that_reads_nothing_is_given_up_after_the_write_stall() {
        let (_l, url) = hung_peer();
        // Far more than the two kernels' buffers hold: the writes stop being taken.
        let body = vec![7u8; 256 << 20];
        let t = std::time::Instant::now();
        let e = stalling(Duration::from_secs(60), Duration::from_millis(300))
            .post(&url)
            .send(&body[..])
            .unwrap_err();
        assert!(e.to_string().contains("stopped reading"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn a_request_timeout_shorter_than_the_stall_is_reported_as_itself() {
        let (_l, url) = hung_peer();
        let e = stalling(Duration::from_secs(60), Duration::from_secs(60))
            .get(&url)
            .config()
            .timeout_global(Some(Duration::from_millis(300)))
            .build()
            .call()
            .unwrap_err();
        assert!(matches!(e, ureq::Error::Timeout(_)), "{e}");
    }

    #[test]
    fn a_connection_watches_its_peer() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        watch_peer(socket2::SockRef::from(&s), Duration::from_secs(6)).unwrap();
        let r = socket2::SockRef::from(&s);
        assert!(r.keepalive().unwrap());
        assert_eq!(r.tcp_keepalive_time().unwrap(), Duration::from_secs(2));
        assert_eq!(r.tcp_keepalive_interval().unwrap(), Duration::from_secs(1));
        assert_eq!(r.tcp_keepalive_retries().unwrap(), 4);
        assert_eq!(r.tcp_user_timeout().unwrap(), Some(Duration::from_secs(6)));
    }
}
