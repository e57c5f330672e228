//! Spaces: a machine's store served over HTTP (`ferry serve`), and the client that moves
//! snapshots between stores by κ (`ferry push` / `ferry pull`). The protocol (docs/api.md):
//!
//! * every request carries `Authorization: Bearer <token>` (no unauthenticated endpoint but
//!   `GET /v1/health`, `GET /v1/ready` and the console's static files);
//! * the sender asks which of a closure's objects the receiver lacks
//!   (`POST /v1/objects/missing`), then sends only those in batches (`POST /v1/objects`;
//!   `POST /v1/objects/fetch` for a pull), each object zstd-compressed when that pays, two
//!   batches in flight; the receiver re-hashes every object before storing it (and is the
//!   only one that hashes it);
//! * a transfer that breaks is resumed by running it again: what arrived is kept (content
//!   addressing), only what is still missing moves;
//! * the snapshot is named only once its whole closure is present and verifies
//!   (`POST /v1/snapshots/{κ}`: Resolving + Verifying, then the ref `snapshot/<hex>`).

pub mod api;
mod client;
mod console;
pub mod gc;
pub mod metrics;
pub mod net;
pub mod owners;
pub mod policy;
pub mod s3;
mod server;
pub mod sessions;
pub mod tls;

pub use client::{
    LogChunk, RemoteStore, SpaceClient, SyncStats, pull, pull_tree, push, send_closure,
    send_objects,
};
pub use policy::Policy;
pub use server::{Space, router, serve};
pub use sessions::{Config, Sessions};

/// Largest object the protocol carries, and the size of its batches.
pub use ferry_store::batch::{BATCH_BYTES, MAX_OBJECT};
/// Largest request or answer body: an object of [`MAX_OBJECT`] with room for its batch entry.
pub const MAX_BODY: usize = MAX_OBJECT + (1 << 20);
/// Most κ in one `missing` query.
pub const MAX_QUERY: usize = 1 << 20;
/// Most objects fetched in one request (256 memory chunks: 16 MiB).
pub const MAX_FETCH: usize = 256;

/// Feeds `data` to every decoder of untrusted input a space has — object batches from peers,
/// the JSON bodies of the API, output logs, policy files, S3 answers — discarding the results: the fuzzing
/// entry point (`fuzz/fuzz_targets/space_inputs.rs`, and a property test on stable). None may
/// panic or allocate without bound.
pub fn fuzz_inputs(data: &[u8]) {
    if let Ok(b) = ferry_store::batch::decode(data) {
        let _ = b.verify();
    }
    let _ = serde_json::from_slice::<api::RunRequest>(data);
    let _ = serde_json::from_slice::<api::PrepareRequest>(data);
    let _ = serde_json::from_slice::<api::MigrateRequest>(data);
    let _ = serde_json::from_slice::<api::SessionInfo>(data);
    let _ = serde_json::from_slice::<api::LendRequest>(data);
    let _ = serde_json::from_slice::<api::ReturnRequest>(data);
    let _ = serde_json::from_slice::<api::CheckpointedRequest>(data);
    let _ = serde_json::from_slice::<api::StandbyRequest>(data);
    let _ = serde_json::from_slice::<api::AdmissionCheck>(data);
    let _ = serde_json::from_slice::<api::SetStandby>(data);
    let _ = ferry_wasi::output::Records::check(data);
    owners::fuzz_answers(data);
    s3::fuzz_answers(data);
    // A lent session's output, appended at each offset of a log that holds some records.
    let log = ferry_wasi::OutputBuffer::from_bytes(vec![1, 2, 0, 0, 0, b'h', b'i']);
    for at in [0, 3, 7, 8] {
        let _ = log.append_at(at, data);
    }
    let _ = ferry_wasi::output::Records::new(data).count();
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = Policy::parse(text, "/nonexistent".into(), "fuzz");
    }
}

#[cfg(test)]
mod fuzz_tests {
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn untrusted_inputs_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            super::fuzz_inputs(&data);
        }

        #[test]
        fn near_valid_s3_listings_never_panic(s in "(<Contents><Key>[a-z/&;#x0-9]{0,8}</Key><Size>[0-9]{0,22}</Size><LastModified>[0-9]{0,6}-[0-9]{1,2}-[0-9]{1,2}T[0-9:.]{0,12}Z?</LastModified></Contents>){0,3}(<IsTruncated>true</IsTruncated>)?(<NextContinuationToken>[a-z&;#x0-9]{0,8}</NextContinuationToken>)?") {
            super::fuzz_inputs(s.as_bytes());
        }

        #[test]
        fn near_valid_policies_never_panic(s in "version = 1\n(env = \\[\"[A-Z]{0,4}\"\\]\n)?(max_memory_mib = [0-9]{1,20}\n)?(\\[\\[mount\\]\\]\nguest = \"[/a-z*.]{0,6}\"\n)?") {
            super::fuzz_inputs(s.as_bytes());
        }
    }
}
