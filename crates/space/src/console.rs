//! The console a browser opens at `/console/`: the JavaScript space (`web/` at the
//! repository's root, built into the binary), which lists this space's sessions and resumes
//! snapshots in the tab. Static files with no secret in them, so served without the token;
//! everything they ask of the space goes through the authenticated API.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The files of `web/` a browser needs, by name.
const FILES: &[(&str, &str, &[u8])] = &[
    (
        "index.html",
        "text/html; charset=utf-8",
        include_bytes!("../../../web/index.html"),
    ),
    ("console.js", JS, include_bytes!("../../../web/console.js")),
    ("worker.js", JS, include_bytes!("../../../web/worker.js")),
    ("lease.js", JS, include_bytes!("../../../web/lease.js")),
    ("resume.js", JS, include_bytes!("../../../web/resume.js")),
    ("capture.js", JS, include_bytes!("../../../web/capture.js")),
    ("globals.js", JS, include_bytes!("../../../web/globals.js")),
    ("objects.js", JS, include_bytes!("../../../web/objects.js")),
    ("wasi.js", JS, include_bytes!("../../../web/wasi.js")),
    ("cbor.js", JS, include_bytes!("../../../web/cbor.js")),
    ("blake3.js", JS, include_bytes!("../../../web/blake3.js")),
    (
        "blake3-wasm.js",
        JS,
        include_bytes!("../../../web/blake3-wasm.js"),
    ),
];
const JS: &str = "text/javascript; charset=utf-8";

/// `GET /console/`: the page.
pub(crate) async fn index() -> Response {
    file("index.html")
}

/// `GET /console/{file}`: one of its scripts.
pub(crate) async fn asset(Path(name): Path<String>) -> Response {
    file(&name)
}

fn file(name: &str) -> Response {
    let Some((_, ty, bytes)) = FILES.iter().find(|(n, _, _)| *n == name) else {
        return (StatusCode::NOT_FOUND, format!("no console file `{name}`\n")).into_response();
    };
    let mut r = (*bytes).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ty));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Cross-origin isolation: a guest's sleep then waits with `Atomics.wait` (it needs
    // SharedArrayBuffer) instead of spinning a core.
    h.insert(
        "Cross-Origin-Opener-Policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        "Cross-Origin-Embedder-Policy",
        HeaderValue::from_static("require-corp"),
    );
    h.insert(
        "X-Content-Type-Options",
        HeaderValue::from_static("nosniff"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every script the page and its worker import is served (a file added to `web/` and
    /// imported, but not listed here, would break the console only in a browser).
    #[test]
    fn every_imported_script_is_served() {
        for (name, _, bytes) in FILES {
            let text = std::str::from_utf8(bytes).unwrap();
            for line in text.lines() {
                for quote in ['"', '\''] {
                    let Some(at) = line.find(&format!("from {quote}./")) else {
                        continue;
                    };
                    let rest = &line[at + 8..];
                    let imported = &rest[..rest.find(quote).unwrap()];
                    assert!(
                        FILES.iter().any(|(n, _, _)| *n == imported),
                        "{name} imports {imported}, which the console does not serve"
                    );
                }
            }
        }
        assert!(
            std::str::from_utf8(FILES[0].2)
                .unwrap()
                .contains("console.js")
        );
        assert!(
            std::str::from_utf8(FILES[1].2)
                .unwrap()
                .contains("worker.js")
        );
    }
}
