;; count.wat with a busy loop ten times longer: long enough to be suspended many times
;; (churn tests); count.wat itself is a conformance-kit guest and stays as it is.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (global $n (mut i32) (i32.const 0))
  (func $fmt (param $v i32) (result i32)
    ;; writes decimal of v + newline at 100.., returns length
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
    (i32.store (i32.const 0) (local.get $p))
    (i32.store (i32.const 4) (local.get $len))
    (local.get $len))
  (func $busy (param $k i32) (result i32)
    (local $i i32) (local $acc i32)
    (loop $l
      (local.set $acc (i32.add (local.get $acc) (i32.mul (local.get $i) (local.get $k))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 30000000))))
    (local.get $acc))
  (func (export "_start")
    (local $i i32)
    (loop $outer
      (drop (call $fmt (i32.add (local.get $i) (call $busy (local.get $i)))))
      (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $outer (i32.lt_u (local.get $i) (i32.const 60)))))
)
