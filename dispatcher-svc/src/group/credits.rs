//! A session's in-flight limit as one pool of credits that every shard of its group takes
//! from ([`crate::shard`]).
//!
//! Contract: at most `max` deliveries assigned or sent to the session and not yet settled,
//! whichever shards issued them. A shard that finds the pool empty registers itself and is
//! woken (its bit returned by [`Credits::give_back`]) when any shard gives a credit back.
//! The registration is made before a second look at the pool, and a give-back looks at the
//! registrations after returning its credit (all sequentially consistent), so a credit given
//! back concurrently is either seen by the second look or its giver sees the registration:
//! no shard waits for a credit that is free.
//!
//! Whether the session is **stalled** (its stream took none of its deliveries for the
//! assignment timeout, [`super::sessions`]) is kept here too: the stream takes deliveries in
//! the order all shards queued them, so a stall is the session's, not one shard's.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};

/// See the module doc.
#[derive(Debug)]
pub struct Credits {
    max: u32,
    used: AtomicU32,
    /// Shards that found the pool empty, one bit each.
    waiting: AtomicU64,
    stalled: AtomicBool,
}

impl Credits {
    /// A pool of `max` credits.
    pub fn new(max: u32) -> Credits {
        Credits {
            max,
            used: AtomicU32::new(0),
            waiting: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
        }
    }

    /// Whether the session is stalled.
    pub fn is_stalled(&self) -> bool {
        self.stalled.load(SeqCst)
    }

    /// Marks the session stalled or reading again; returns whether that changed it.
    pub fn set_stalled(&self, stalled: bool) -> bool {
        self.stalled.swap(stalled, SeqCst) != stalled
    }

    /// The session's in-flight limit.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// Credits taken now.
    pub fn used(&self) -> u32 {
        self.used.load(SeqCst)
    }

    fn try_take(&self) -> bool {
        self.used
            .fetch_update(SeqCst, SeqCst, |used| (used < self.max).then_some(used + 1))
            .is_ok()
    }

    /// Takes a credit for shard `shard`; `false` when none is free, and then the shard is
    /// registered to be woken when one comes back.
    pub fn take(&self, shard: usize) -> bool {
        if self.try_take() {
            return true;
        }
        // Every pump asks every full session again: once registered, a look is enough (a
        // give-back that clears the bit after this look wakes the shard all the same).
        let bit = 1 << (shard % 64);
        if self.waiting.load(SeqCst) & bit == 0 {
            self.waiting.fetch_or(bit, SeqCst);
        }
        self.try_take()
    }

    /// Gives a credit back; returns the shards waiting for one (their registrations cleared),
    /// to be woken.
    pub fn give_back(&self) -> u64 {
        let _ = self
            .used
            .fetch_update(SeqCst, SeqCst, |used| used.checked_sub(1));
        if self.waiting.load(SeqCst) == 0 {
            0
        } else {
            self.waiting.swap(0, SeqCst)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_pool_bounds_every_shard_together_and_names_who_waits() {
        let credits = Credits::new(2);
        assert!(credits.take(0));
        assert!(credits.take(1));
        assert!(
            !credits.take(1),
            "the pool is shared: shard 1 finds it empty"
        );
        assert!(!credits.take(3));
        assert_eq!(credits.give_back(), 0b1010, "shards 1 and 3 are woken");
        assert_eq!(
            credits.give_back(),
            0,
            "registrations are cleared once told"
        );
        assert_eq!(credits.used(), 0);
        assert_eq!(credits.give_back(), 0);
        assert_eq!(credits.used(), 0, "never below zero");
    }

    /// Two threads take and give back concurrently; a taker that is refused must either be
    /// named by a later give-back or have found a credit itself: never both missed.
    #[test]
    fn a_refused_shard_is_never_forgotten() {
        for _ in 0..200 {
            let credits = Arc::new(Credits::new(1));
            assert!(credits.take(0));
            let giver = {
                let credits = Arc::clone(&credits);
                std::thread::spawn(move || credits.give_back())
            };
            let took = credits.take(1);
            let woken = giver.join().unwrap();
            assert!(
                took || woken & 0b10 != 0,
                "shard 1 was refused while the credit came back, and not woken"
            );
        }
    }
}
