//! The lock policy, in one place (docs/ARCHITECTURE.md states it): a poisoned
//! `std::sync::Mutex` is taken over as it is, never skipped and never a panic of its own.
//!
//! Why: a lock is poisoned when a thread panicked while holding it. Every critical
//! section of this crate is a short update that keeps its data consistent at each point
//! where it could panic (a map insert, a counter, a swap of a whole value), so the data
//! behind a poisoned lock is as valid as after any other update. Skipping the update
//! instead (`if let Ok(..) = m.lock()`) silently loses it, as a released stream slot or
//! a trainer channel once was; panicking again would take a second thread down for the
//! first one's bug. The panic itself is already reported by the panicking thread.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking a poisoned lock over (see the module docs).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_poisoned_lock_is_taken_over_with_its_data() {
        let m = Arc::new(Mutex::new(vec![1]));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            g.push(2);
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        lock(&m).push(3);
        assert_eq!(*lock(&m), vec![1, 2, 3]);
    }
}
