//! Buffers for the activations an operator lays out for its prefill tiles, taken from a
//! per-thread spare and given back when dropped. Each prefill operator lays its activations out
//! anew (hundreds of KiB to a few MiB); allocated and zeroed each time, one thread wrote zeros
//! over memory that the pool's threads then overwrote while the other threads waited.

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::thread::LocalKey;

/// A per-thread spare buffer of `T`: declared with
/// `thread_local! { static NAME: Cell<Vec<T>> = const { Cell::new(Vec::new()) }; }`.
pub(crate) type Home<T> = LocalKey<Cell<Vec<T>>>;

/// `n` values of `T` in memory from `home`'s spare, which they go back to when dropped (where
/// the spare then holds less).
pub(crate) struct Spared<T: Copy + 'static> {
    v: Vec<T>,
    home: &'static Home<T>,
}

impl<T: Copy + 'static> Spared<T> {
    /// Room for `n` values from `home`'s spare, to be written and then declared filled.
    pub(crate) fn room(home: &'static Home<T>, n: usize) -> Room<T> {
        let mut v = home.take();
        v.clear();
        v.reserve(n);
        Room {
            spared: Spared { v, home },
            n,
        }
    }
}

/// Room for a [`Spared`] buffer's values, not yet written (dropped unfilled, its memory still
/// goes back to the spare).
pub(crate) struct Room<T: Copy + 'static> {
    spared: Spared<T>,
    n: usize,
}

impl<T: Copy + 'static> Room<T> {
    /// The room, to write the values into.
    pub(crate) fn uninit(&mut self) -> &mut [MaybeUninit<T>] {
        &mut self.spared.v.spare_capacity_mut()[..self.n]
    }

    /// The buffer, its values written.
    ///
    /// # Safety
    /// Every one of the room's values was written (the buffer is read as initialised after).
    pub(crate) unsafe fn filled(self) -> Spared<T> {
        let Room { mut spared, n } = self;
        // SAFETY: the capacity is at least n (`Spared::room`) and all n values were written
        // (the caller's contract); `T: Copy` has no drop to skip.
        unsafe { spared.v.set_len(n) };
        spared
    }
}

impl<T: Copy + 'static> std::ops::Deref for Spared<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.v
    }
}

impl<T: Copy + 'static> Drop for Spared<T> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        // `try_with`: nothing to keep while the thread's locals are being torn down.
        let _ = self.home.try_with(|spare| {
            let old = spare.take();
            spare.set(if old.capacity() >= v.capacity() {
                old
            } else {
                v
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static HOME: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
    }

    fn fill_with(n: usize, base: u64) -> Spared<u64> {
        let mut room = Spared::room(&HOME, n);
        for (i, x) in room.uninit().iter_mut().enumerate() {
            x.write(base + i as u64);
        }
        // SAFETY: the loop wrote all n values.
        unsafe { room.filled() }
    }

    /// The values are what was written; a dropped buffer's memory serves the next one, and two
    /// alive at once have their own.
    #[test]
    fn reuses_the_spare() {
        let a = fill_with(1000, 7);
        assert_eq!(a.len(), 1000);
        assert!(a.iter().enumerate().all(|(i, &x)| x == 7 + i as u64));
        let at = a.as_ptr();
        drop(a);
        let b = fill_with(500, 1);
        assert_eq!(b.as_ptr(), at, "the spare's memory is used again");
        let c = fill_with(300, 2);
        assert_ne!(c.as_ptr(), b.as_ptr());
        assert_eq!((b[499], c[299]), (500, 301));
    }
}
