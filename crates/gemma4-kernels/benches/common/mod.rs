//! What the kernel benches share.

use std::time::Instant;

/// Milliseconds per call of `f` over `reps` calls, after one untimed call.
pub fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() * 1e3 / reps as f64
}
