//! `Control::pauses`: one entry per snapshot the guest went on from, none for a probe (served
//! without a snapshot) or for the final suspend (the guest does not go on).

use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use ferry_engine::{Control, EngineKind, Outcome, Request, Runtime, SnapshotMeta, Start};
use ferry_store::MemStore;
use ferry_wasi::{HostClock, WasiCtx};

/// Counts for ever: every way back through the loop is a safe point.
const SPINNER: &str = r#"(module
  (memory (export "memory") 1)
  (func (export "_start") (local $i i64)
    (loop $l
      (local.set $i (i64.add (local.get $i) (i64.const 1)))
      (br $l))))"#;

#[test]
fn each_checkpoint_the_guest_goes_on_from_is_one_pause() {
    let wasm = wat::parse_str(SPINNER).unwrap();
    for kind in EngineKind::ALL {
        let rt = Runtime::new(kind, None).unwrap();
        let store = MemStore::new();
        let prepared = rt.prepare(&store, &wasm, &|_| {}).unwrap();
        let c = Arc::new(Control::new());
        let stdio = crate::every_safe_point::stdio(&Default::default());
        let ctx = WasiCtx::new(
            vec!["t".into()],
            vec![],
            vec![],
            stdio,
            Box::new(HostClock::default()),
            c.interrupt(),
        )
        .unwrap();
        let (tx, rx) = channel();
        let outcome = std::thread::scope(|s| {
            let (c2, store, prepared, rt) = (c.clone(), &store, &prepared, &rt);
            let h = std::thread::Builder::new()
                .stack_size(64 << 20)
                .spawn_scoped(s, move || {
                    let meta = SnapshotMeta::fresh("t");
                    rt.run(
                        prepared,
                        ctx,
                        c2,
                        Start::Fresh,
                        store,
                        meta,
                        &mut |r, why| {
                            r.unwrap();
                            tx.send(why).unwrap();
                        },
                    )
                })
                .unwrap();
            for _ in 0..2 {
                c.request(Request::Checkpoint);
                assert_eq!(rx.recv().unwrap(), Request::Checkpoint);
                std::thread::sleep(Duration::from_millis(20));
            }
            c.request(Request::Probe);
            std::thread::sleep(Duration::from_millis(50));
            c.request(Request::Suspend);
            h.join().unwrap()
        })
        .unwrap();
        assert!(
            matches!(outcome, Outcome::Suspended(_)),
            "{kind}: {outcome:?}"
        );
        let pauses = c.pauses();
        assert_eq!(pauses.len(), 2, "{kind}: {pauses:?}");
        assert_eq!(c.safe_point_delays().len(), 4, "{kind}");
    }
}
