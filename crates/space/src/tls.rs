//! TLS between spaces and their clients.
//!
//! A space serves HTTPS when `ferry serve` is given a certificate chain and its key (PEM):
//! [`server_config`] loads them and [`TlsListener`] does each handshake on a task of its own,
//! so a slow or broken client never holds up the others. Clients — the CLI and spaces talking
//! to their peers — trust the certificates of Mozilla's root program, or, with `FERRY_TLS_CA`
//! set to a PEM file, the certificates in that file instead ([`client_config`]): a private CA,
//! or a space's self-signed certificate.
//!
//! A plain-HTTP request sent to an HTTPS space is answered, in plain HTTP, with a 400 saying
//! to use `https://` — instead of a closed connection the user has to puzzle over.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

/// How long a client has to complete its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// The server side of TLS: the certificate chain in `cert` and the private key in `key`
/// (PEM files), with the errors a user can act on.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    let (chain, key_der) = read_identity(cert, key)?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| mismatch(cert, key, e))?;
    Ok(Arc::new(config))
}

/// The crypto of every TLS config made here: *ring*, named rather than left to the process
/// default, which panics if a dependency ever builds in a second provider. (rustls 0.23.48
/// deprecates *ring*'s provider for lacking post-quantum key exchange; aws-lc-rs would need
/// cmake and a longer build.)
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    #[allow(deprecated)]
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificate chain in `cert` and the private key in `key` (PEM files), with the errors
/// a user can act on.
fn read_identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            format!(
                "cannot read a certificate chain from {}: {e}",
                cert.display()
            )
        })?;
    if chain.is_empty() {
        return Err(format!("no certificate in {}", cert.display()));
    }
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("cannot read a private key from {}: {e}", key.display()))?;
    Ok((chain, key_der))
}

/// rustls refused the key in `key` for the certificate in `cert`.
fn mismatch(cert: &Path, key: &Path, e: rustls::Error) -> String {
    format!(
        "the key in {} does not serve the certificate in {}: {e}",
        key.display(),
        cert.display()
    )
}

/// What clients trust: the certificates in the PEM file `FERRY_TLS_CA` names, or else
/// Mozilla's roots. A file that cannot be read is reported once, on stderr, and then trusts
/// nothing (every HTTPS connection fails, saying why) rather than silently trusting more.
pub fn client_config() -> ureq::tls::TlsConfig {
    static CONFIG: OnceLock<ureq::tls::TlsConfig> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            ureq::tls::TlsConfig::builder()
                .provider(ureq::tls::TlsProvider::Rustls)
                .root_certs(default_roots())
                .build()
        })
        .clone()
}

/// The roots [`client_config`] trusts.
fn default_roots() -> ureq::tls::RootCerts {
    match std::env::var_os("FERRY_TLS_CA") {
        None => ureq::tls::RootCerts::WebPki,
        Some(path) => match read_roots(Path::new(&path)) {
            Ok(certs) => ureq::tls::RootCerts::new_with_certs(&certs),
            Err(e) => {
                eprintln!("ferry: FERRY_TLS_CA: {e}; no HTTPS peer is trusted");
                ureq::tls::RootCerts::new_with_certs(&[])
            }
        },
    }
}

/// What a space trusts and presents when it speaks to etcd over HTTPS (`ferry serve
/// --etcd-ca`, `--etcd-cert`, `--etcd-key`): the certificates in `ca` (else what
/// [`client_config`] trusts), and the client certificate chain `cert` with its key, for an
/// etcd started with `--client-cert-auth`. Files that cannot be read, hold no certificate or
/// key, or a key that does not serve the certificate are refused here, before any
/// connection.
pub fn etcd_client_config(
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<ureq::tls::TlsConfig, String> {
    let roots = match ca {
        Some(ca) => ureq::tls::RootCerts::new_with_certs(&read_roots(ca)?),
        None => default_roots(),
    };
    let mut builder = ureq::tls::TlsConfig::builder()
        .provider(ureq::tls::TlsProvider::Rustls)
        .root_certs(roots);
    if let Some((cert, key)) = identity {
        let (chain, key_der) = read_identity(cert, key)?;
        // The pair checked as rustls will use it, so a mismatch is said now, naming the
        // files, rather than at each connection.
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_client_auth_cert(chain.clone(), key_der)
            .map_err(|e| mismatch(cert, key, e))?;
        let chain: Vec<_> = chain
            .iter()
            .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
            .collect();
        let key = std::fs::read(key)
            .map_err(|e| e.to_string())
            .and_then(|pem| ureq::tls::PrivateKey::from_pem(&pem).map_err(|e| e.to_string()))
            .map_err(|e| format!("cannot read a private key from {}: {e}", key.display()))?;
        builder = builder.client_cert(Some(ureq::tls::ClientCert::new_with_certs(&chain, key)));
    }
    Ok(builder.build())
}

/// `msg` with a hint for the TLS failure it reports, when it has one a user can act on.
pub fn explain(msg: String) -> String {
    let hint = if msg.contains("CaUsedAsEndEntity") {
        "the space's certificate says CA:TRUE; a self-signed one must say CA:FALSE \
         (docs/api.md, \"TLS\")"
    } else if msg.contains("UnknownIssuer") {
        "no trusted certificate vouches for the space's; set FERRY_TLS_CA to a PEM file \
         holding its CA (or the certificate itself)"
    } else if msg.contains("NotValidForName") {
        "the space's certificate is not for this host name or address"
    } else {
        return msg;
    };
    format!("{msg} ({hint})")
}

fn read_roots(path: &Path) -> Result<Vec<ureq::tls::Certificate<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(&pem) {
        if let ureq::tls::PemItem::Certificate(c) =
            item.map_err(|e| format!("{}: {e}", path.display()))?
        {
            certs.push(c);
        }
    }
    if certs.is_empty() {
        return Err(format!("no certificate in {}", path.display()));
    }
    Ok(certs)
}

/// TLS connections accepted on a TCP listener, each handshake on a task of its own (at most
/// [`HANDSHAKE`] long), every connection watching its peer ([`crate::net::watch_peer`]).
pub struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl TlsListener {
    /// Accepts on `tcp` from now on (call within a tokio runtime).
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let (s, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors, say: wait a little instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                crate::net::watch_accepted(socket2::SockRef::from(&s));
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let shake = async {
                        if speaks_plain_http(&s).await {
                            refuse_plain_http(s, local).await;
                            return None;
                        }
                        acceptor.accept(s).await.ok()
                    };
                    match tokio::time::timeout(HANDSHAKE, shake).await {
                        Ok(Some(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(None) => debug!(%peer, "TLS handshake failed"),
                        Err(_) => debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { ready, local })
    }
}

/// Whether the client's first byte starts an HTTP request (a letter) rather than a TLS
/// record (0x16, a handshake).
async fn speaks_plain_http(s: &TcpStream) -> bool {
    let mut first = [0u8; 1];
    matches!(s.peek(&mut first).await, Ok(1) if first[0].is_ascii_alphabetic())
}

/// Answers a plain-HTTP request with a 400 that says to use HTTPS: its head read first, the
/// rest (a body) drained after the answer, so that the client sees the answer rather than a
/// reset.
async fn refuse_plain_http(mut s: TcpStream, local: SocketAddr) {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 << 10 {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    // The address the client used (its Host header), else the one listened on.
    let host = String::from_utf8_lossy(&head)
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("host")
                .then(|| value.trim().to_owned())
        })
        .filter(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_graphic()))
        .unwrap_or_else(|| local.to_string());
    let why = format!("this space speaks HTTPS: use https://{host}\n");
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{why}",
        why.len()
    );
    if s.write_all(answer.as_bytes()).await.is_err() || s.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut left = 64usize << 20;
        while let Ok(n @ 1..) = s.read(&mut buf).await {
            left = left.saturating_sub(n);
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accepting task is gone (it never returns while this listener lives).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
