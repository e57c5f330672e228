;; The conformance kit's copy of guests/wat/data-drop.wat with a shorter busy loop (the
;; interpreter runs it several times per check); frozen with the kit.
;;
;; Passive data segments, two dropped at the start (`data.drop`, in a function the
;; transform instruments and in one it leaves as it is), one not: after a long counting loop
;; (suspended many times by the churn tests) the program copies the kept segment in again
;; and prints it, then copies a dropped one, which must trap (exit 134) however many times
;; the run was suspended and resumed. A resume that forgot the drop would print "dropped
;; segment still there" a second time and exit 0.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data $dropped "dropped segment still there\n")
  (data $kept "kept segment copied again\n")
  (data $early "dropped early\n")
  ;; Prints len bytes at p.
  (func $print (param $p i32) (param $len i32)
    (i32.store (i32.const 0) (local.get $p))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
  ;; No loop, no call: a function the transform leaves as it is.
  (func $drop_early
    (data.drop $early))
  (func $fmt (param $v i32) (result i32)
    (local $p i32) (local $len i32)
    (local.set $p (i32.const 120))
    (i32.store8 (local.get $p) (i32.const 10))
    (local.set $len (i32.const 1))
    (loop $l
      (local.set $p (i32.sub (local.get $p) (i32.const 1)))
      (i32.store8 (local.get $p) (i32.add (i32.const 48) (i32.rem_u (local.get $v) (i32.const 10))))
      (local.set $len (i32.add (local.get $len) (i32.const 1)))
      (local.set $v (i32.div_u (local.get $v) (i32.const 10)))
      (br_if $l (local.get $v)))
    (call $print (local.get $p) (local.get $len))
    (local.get $len))
  (func $busy (param $k i32) (result i32)
    (local $i i32) (local $acc i32)
    (loop $l
      (local.set $acc (i32.add (local.get $acc) (i32.mul (local.get $i) (local.get $k))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 1000000))))
    (local.get $acc))
  (func (export "_start")
    (local $i i32)
    (memory.init $dropped (i32.const 200) (i32.const 0) (i32.const 28))
    (data.drop $dropped)
    (call $drop_early)
    (call $print (i32.const 200) (i32.const 28))
    (loop $outer
      (drop (call $fmt (i32.add (local.get $i) (call $busy (local.get $i)))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $outer (i32.lt_u (local.get $i) (i32.const 40))))
    (memory.init $kept (i32.const 300) (i32.const 0) (i32.const 26))
    (call $print (i32.const 300) (i32.const 26))
    ;; Dropped: an empty copy from offset 0 is still allowed, this one must trap.
    (memory.init $early (i32.const 400) (i32.const 0) (i32.const 0))
    (memory.init $dropped (i32.const 400) (i32.const 0) (i32.const 28))
    (call $print (i32.const 400) (i32.const 28)))
)
