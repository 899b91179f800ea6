//! A group's pending timers: ACK deadlines and backoff ends, one per delivery at most.
//!
//! Nearly every timer is an ACK deadline set when a delivery is written (the write's time
//! plus the same timeout), so they come in time order and most are cleared in about that
//! order, by ACKs. Those go to a queue, pushed at the back and never searched; a cleared one
//! stays there, stale, until [`Timers::tidy`] drops it (from the front as ACKs come in, or
//! all at once when stale entries outnumber what is tracked). A timer set out of order (a
//! backoff, an extension) goes to an ordered set and is removed when cleared. What fires is
//! checked against the delivery's own `timer`, so a stale entry never acts.
//!
//! Before, every timer was an ordered-set entry inserted and removed once per delivery, with
//! its node splits and merges on the actor's path (issue 12, docs/BENCHMARKS.md).

use std::collections::{BTreeSet, VecDeque};
use std::time::Instant;

use super::Delivery;

/// Stale queue entries tolerated beyond twice the deliveries tracked before the queue is
/// compacted.
const STALE_SLACK: usize = 1024;

/// A group's timers.
#[derive(Debug, Default)]
pub struct Timers {
    /// Timers set in time order, some of them stale.
    in_order: VecDeque<(Instant, u64)>,
    /// Timers set out of order.
    other: BTreeSet<(Instant, u64)>,
}

impl Timers {
    /// Sets `delivery`'s (`seq`) timer to `at`, replacing the one it had.
    pub fn set(&mut self, delivery: &mut Delivery, seq: u64, at: Instant) {
        self.clear(delivery, seq);
        delivery.timer = Some(at);
        match self.in_order.back() {
            Some(&(last, _)) if at < last => {
                self.other.insert((at, seq));
            }
            _ => self.in_order.push_back((at, seq)),
        }
    }

    /// Clears `delivery`'s (`seq`) timer, if it has one.
    pub fn clear(&mut self, delivery: &mut Delivery, seq: u64) {
        if let Some(at) = delivery.timer.take() {
            // An in-order entry stays until tidied; the delivery's `timer` no longer names it.
            self.other.remove(&(at, seq));
        }
    }

    /// When the earliest entry is due (it may be stale: then it fires nothing).
    pub fn first(&self) -> Option<Instant> {
        let queued = self.in_order.front().map(|&(at, _)| at);
        let other = self.other.first().map(|&(at, _)| at);
        match (queued, other) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Takes the earliest entry if it is due at `now`; the caller checks that it is still
    /// its delivery's timer.
    pub fn pop_due(&mut self, now: Instant) -> Option<(Instant, u64)> {
        let queued = self.in_order.front().copied().filter(|&(at, _)| at <= now);
        let other = self.other.first().copied().filter(|&(at, _)| at <= now);
        match (queued, other) {
            (Some(a), Some(b)) if b < a => self.other.pop_first(),
            (Some(_), _) => self.in_order.pop_front(),
            (None, Some(_)) => self.other.pop_first(),
            (None, None) => None,
        }
    }

    /// Drops stale entries: those at the queue's front, and every one once they outnumber
    /// twice the `tracked` deliveries (so the queue stays proportional to what is tracked).
    /// `is_live(at, seq)`: whether `seq`'s timer is still `at`.
    pub fn tidy(&mut self, tracked: usize, is_live: impl Fn(Instant, u64) -> bool) {
        while let Some(&(at, seq)) = self.in_order.front() {
            if is_live(at, seq) {
                break;
            }
            self.in_order.pop_front();
        }
        if self.in_order.len() > 2 * tracked + STALE_SLACK {
            self.in_order.retain(|&(at, seq)| is_live(at, seq));
            if self.in_order.capacity() > 4 * (self.in_order.len() + STALE_SLACK) {
                self.in_order.shrink_to_fit();
            }
        }
    }

    /// Entries held, stale ones included.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.in_order.len() + self.other.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;

    fn delivery(seq: u64) -> Delivery {
        Delivery::numbered(seq)
    }

    /// Fires what is due at `now` as the group does: an entry acts only if it is still its
    /// delivery's timer.
    fn fire(
        timers: &mut Timers,
        deliveries: &mut HashMap<u64, Delivery>,
        now: Instant,
    ) -> Vec<u64> {
        let mut fired = Vec::new();
        while let Some((at, seq)) = timers.pop_due(now) {
            if let Some(d) = deliveries.get_mut(&seq)
                && d.timer == Some(at)
            {
                timers.clear(d, seq);
                fired.push(seq);
            }
        }
        fired
    }

    #[test]
    fn timers_fire_in_time_order_once_and_cleared_ones_never() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut timers = Timers::default();
        let mut deliveries: HashMap<u64, Delivery> = (1..=6).map(|s| (s, delivery(s))).collect();
        for (seq, ms) in [(1, 100), (2, 200), (3, 300), (4, 150), (5, 400)] {
            timers.set(deliveries.get_mut(&seq).unwrap(), seq, at(ms));
        }
        // 2 is ACKed; 3 is extended (set again, later); 6 gets a backoff before everything.
        timers.clear(deliveries.get_mut(&2).unwrap(), 2);
        timers.set(deliveries.get_mut(&3).unwrap(), 3, at(500));
        timers.set(deliveries.get_mut(&6).unwrap(), 6, at(50));
        assert_eq!(timers.first(), Some(at(50)));
        assert_eq!(fire(&mut timers, &mut deliveries, at(160)), vec![6, 1, 4]);
        assert_eq!(
            fire(&mut timers, &mut deliveries, at(160)),
            Vec::<u64>::new()
        );
        assert_eq!(fire(&mut timers, &mut deliveries, at(450)), vec![5]);
        assert_eq!(fire(&mut timers, &mut deliveries, at(1000)), vec![3]);
        assert_eq!(timers.first(), None);
    }

    #[test]
    fn stale_entries_stay_proportional_to_what_is_tracked() {
        let start = Instant::now();
        let mut timers = Timers::default();
        let mut deliveries: HashMap<u64, Delivery> = HashMap::new();
        // One delivery whose timer stays at the queue's front, while 100,000 others are
        // written and ACKed out of order behind it, about a hundred at a time.
        deliveries.insert(0, delivery(0));
        timers.set(deliveries.get_mut(&0).unwrap(), 0, start);
        let mut largest = 0;
        for seq in 1..=100_000u64 {
            let mut d = delivery(seq);
            timers.set(&mut d, seq, start + Duration::from_micros(seq));
            deliveries.insert(seq, d);
            if seq > 102 {
                // ACKed in pairs, the later one first (1 never: it stays, as 0 does).
                let acked = if seq % 2 == 0 { seq - 99 } else { seq - 101 };
                if let Some(mut d) = deliveries.remove(&acked) {
                    timers.clear(&mut d, acked);
                }
            }
            let is_live = |at, seq| deliveries.get(&seq).is_some_and(|d| d.timer == Some(at));
            timers.tidy(deliveries.len(), is_live);
            largest = largest.max(timers.held());
        }
        assert!(
            largest <= 2 * 110 + STALE_SLACK + 1,
            "held up to {largest} entries for about a hundred timers"
        );
        // And the front one still fires.
        let fired = fire(&mut timers, &mut deliveries, start);
        assert_eq!(fired, vec![0]);
    }
}
