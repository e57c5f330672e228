//! Engine tests: the transform and the run loop, suspended at *every* safe point in turn.

#![allow(clippy::unwrap_used)] // a test that cannot unwrap should fail loudly

mod every_safe_point;
mod pauses;
mod throttle;
