;; Conformance guest: a funcref table driven through call_indirect, mutable globals of every
;; value type (i32, i64, f32, f64, v128) updated each round, memory.grow every few rounds, and
;; a recursive helper, so a snapshot taken mid-run carries all of them. Prints one line per
;; round: the round, the table slot used, and a digest of every global and of memory.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (type $op (func (param i64) (result i64)))
  (table 4 funcref)
  (elem (i32.const 0) $double $square_mod $rotate $spin)
  (global $gi (mut i32) (i32.const 7))
  (global $gl (mut i64) (i64.const 1))
  (global $gf (mut f32) (f32.const 0.5))
  (global $gd (mut f64) (f64.const 0.25))
  (global $gv (mut v128) (v128.const i32x4 1 2 3 4))

  (func $double (type $op) (i64.mul (local.get 0) (i64.const 2)))
  (func $square_mod (type $op)
    (i64.rem_u (i64.mul (local.get 0) (local.get 0)) (i64.const 1000000007)))
  (func $rotate (type $op) (i64.rotl (local.get 0) (i64.const 13)))
  ;; A busy loop (many safe points) with a result that depends on every iteration.
  (func $spin (type $op)
    (local $i i32) (local $acc i64)
    (local.set $acc (local.get 0))
    (loop $l
      (local.set $acc (i64.add (i64.mul (local.get $acc) (i64.const 6364136223846793005))
                               (i64.const 1442695040888963407)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 20000))))
    (local.get $acc))
  ;; Recursion: sum of depth..1 through call_indirect on the way down.
  (func $deep (param $d i32) (param $x i64) (result i64)
    (if (result i64) (i32.eqz (local.get $d))
      (then (local.get $x))
      (else
        (i64.add
          (call $deep (i32.sub (local.get $d) (i32.const 1))
            (call_indirect (type $op) (local.get $x) (i32.rem_u (local.get $d) (i32.const 3))))
          (i64.extend_i32_u (local.get $d))))))

  ;; Writes "<hex of v>" (16 digits) at $p; returns $p + 16.
  (func $hex (param $p i32) (param $v i64) (result i32)
    (local $i i32) (local $d i32)
    (loop $l
      (local.set $d (i32.wrap_i64 (i64.and (i64.shr_u (local.get $v)
        (i64.extend_i32_u (i32.sub (i32.const 60) (i32.mul (local.get $i) (i32.const 4))))) (i64.const 15))))
      (i32.store8 (i32.add (local.get $p) (local.get $i))
        (i32.add (local.get $d) (select (i32.const 48) (i32.const 87) (i32.lt_u (local.get $d) (i32.const 10)))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 16))))
    (i32.add (local.get $p) (i32.const 16)))

  (func $digest_memory (result i64)
    (local $p i32) (local $end i32) (local $h i64)
    (local.set $end (i32.mul (memory.size) (i32.const 65536)))
    (local.set $p (i32.const 4096))
    (loop $l
      (local.set $h (i64.add (i64.mul (local.get $h) (i64.const 31)) (i64.load (local.get $p))))
      (local.set $p (i32.add (local.get $p) (i32.const 4096)))
      (br_if $l (i32.lt_u (local.get $p) (local.get $end))))
    (local.get $h))

  (func $line (param $round i32) (param $x i64)
    (local $p i32)
    (local.set $p (call $hex (i32.const 256) (i64.extend_i32_u (local.get $round))))
    (i32.store8 (local.get $p) (i32.const 32))
    (local.set $p (call $hex (i32.add (local.get $p) (i32.const 1)) (local.get $x)))
    (i32.store8 (local.get $p) (i32.const 32))
    (local.set $p (call $hex (i32.add (local.get $p) (i32.const 1))
      (i64.xor (i64.extend_i32_u (global.get $gi)) (global.get $gl))))
    (i32.store8 (local.get $p) (i32.const 32))
    (local.set $p (call $hex (i32.add (local.get $p) (i32.const 1))
      (i64.xor (i64.extend_i32_u (i32.reinterpret_f32 (global.get $gf))) (i64.reinterpret_f64 (global.get $gd)))))
    (i32.store8 (local.get $p) (i32.const 32))
    (local.set $p (call $hex (i32.add (local.get $p) (i32.const 1))
      (i64.xor (i64x2.extract_lane 0 (global.get $gv)) (i64x2.extract_lane 1 (global.get $gv)))))
    (i32.store8 (local.get $p) (i32.const 32))
    (local.set $p (call $hex (i32.add (local.get $p) (i32.const 1)) (call $digest_memory)))
    (i32.store8 (local.get $p) (i32.const 10))
    (i32.store (i32.const 0) (i32.const 256))
    (i32.store (i32.const 4) (i32.sub (i32.add (local.get $p) (i32.const 1)) (i32.const 256)))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))

  (func (export "_start")
    (local $round i32) (local $x i64)
    (local.set $x (i64.const 3))
    (loop $rounds
      (local.set $x (call_indirect (type $op) (local.get $x) (i32.rem_u (local.get $round) (i32.const 4))))
      (local.set $x (call $deep (i32.const 200) (local.get $x)))
      (global.set $gi (i32.add (i32.mul (global.get $gi) (i32.const 3)) (local.get $round)))
      (global.set $gl (i64.add (global.get $gl) (local.get $x)))
      (global.set $gf (f32.add (global.get $gf) (f32.const 1.25)))
      (global.set $gd (f64.mul (global.get $gd) (f64.const 1.5)))
      (global.set $gv (i32x4.add (global.get $gv) (i32x4.splat (local.get $round))))
      (if (i32.eqz (i32.rem_u (local.get $round) (i32.const 5)))
        (then (drop (memory.grow (i32.const 1)))))
      ;; Leave a trace in the newest page so the memory digest changes.
      (i64.store (i32.sub (i32.mul (memory.size) (i32.const 65536)) (i32.const 4096)) (local.get $x))
      (call $line (local.get $round) (local.get $x))
      (local.set $round (i32.add (local.get $round) (i32.const 1)))
      (br_if $rounds (i32.lt_u (local.get $round) (i32.const 40)))))
)
