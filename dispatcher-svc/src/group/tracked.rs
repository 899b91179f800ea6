//! A group's tracked deliveries, by sequence number.
//!
//! Sequence numbers are issued in order, one per admitted record, and deliveries mostly settle
//! in about that order. So they are kept in a ring indexed by `seq - base` rather than in a
//! hash map: the actor looks each one up several times (assigned, written, ACKed, durable,
//! retired), and with a map each lookup landed on a random slot of a table of ~300-byte
//! entries far larger than the CPU caches — most of the actor's own time was spent waiting
//! for those loads (issue 12, docs/BENCHMARKS.md). In the ring, neighbouring sequence numbers
//! are neighbours in memory, and a delivery is moved in once and out once.
//!
//! Contract:
//! * Lookups, inserts and removals are O(1) (amortized), for any sequence number.
//! * Memory stays bounded by what is tracked, whatever one delivery does: the ring spans at
//!   most [`SPAN_PER_LIVE`] slots per delivery it holds (and at least [`MIN_SPAN`]). A
//!   delivery the ring's front would otherwise hold back — one waiting out a long backoff
//!   while thousands of newer ones settle — moves to a side map of stragglers, where it stays
//!   until it is removed.
//! * Iteration order is by sequence number within the ring, stragglers after; callers do not
//!   rely on it.

use std::collections::VecDeque;

use super::{Delivery, FastMap};

/// Slots the ring may span per delivery it holds before its front ones move to the side map.
const SPAN_PER_LIVE: usize = 4;

/// Slots the ring may always span, however few deliveries it holds.
const MIN_SPAN: usize = 4096;

/// A group's deliveries by sequence number.
#[derive(Debug, Default)]
pub struct Tracked {
    /// The deliveries of sequence numbers `base..base + ring.len()`; `None` where settled
    /// (or moved to `stragglers`). Never starts with `None`.
    ring: VecDeque<Option<Delivery>>,
    /// The sequence number of `ring[0]`.
    base: u64,
    /// Deliveries in the ring.
    in_ring: usize,
    /// Deliveries whose sequence number the ring no longer spans.
    stragglers: FastMap<u64, Delivery>,
}

impl Tracked {
    /// Deliveries tracked.
    pub fn len(&self) -> usize {
        self.in_ring + self.stragglers.len()
    }

    /// Whether none is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tracks `delivery` as `seq` (sequence numbers are issued in increasing order; one
    /// tracked already is replaced).
    pub fn insert(&mut self, seq: u64, delivery: Delivery) {
        if self.ring.is_empty() && seq >= self.base {
            self.base = seq;
        }
        if seq < self.base {
            self.stragglers.insert(seq, delivery);
            return;
        }
        let index = (seq - self.base) as usize;
        if index >= self.ring.len() {
            self.ring.resize_with(index, || None);
            self.ring.push_back(Some(delivery));
            self.in_ring += 1;
        } else {
            let slot = &mut self.ring[index];
            if slot.is_none() {
                self.in_ring += 1;
            }
            *slot = Some(delivery);
        }
        self.bound_span();
    }

    /// The delivery tracked as `seq`.
    pub fn get(&self, seq: u64) -> Option<&Delivery> {
        if seq >= self.base {
            self.ring.get(self.index(seq)?)?.as_ref()
        } else {
            self.stragglers.get(&seq)
        }
    }

    /// The delivery tracked as `seq`, to change.
    pub fn get_mut(&mut self, seq: u64) -> Option<&mut Delivery> {
        if seq >= self.base {
            let index = self.index(seq)?;
            self.ring.get_mut(index)?.as_mut()
        } else {
            self.stragglers.get_mut(&seq)
        }
    }

    /// Stops tracking `seq`; its delivery, if it was tracked.
    pub fn remove(&mut self, seq: u64) -> Option<Delivery> {
        if seq < self.base {
            return self.stragglers.remove(&seq);
        }
        let index = self.index(seq)?;
        let delivery = self.ring.get_mut(index)?.take()?;
        self.in_ring -= 1;
        if index == 0 {
            self.pop_settled_front();
            self.release_spare_capacity();
        }
        Some(delivery)
    }

    /// Every tracked delivery with its sequence number.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Delivery)> {
        let base = self.base;
        self.ring
            .iter()
            .enumerate()
            .filter_map(move |(index, slot)| Some((base + index as u64, slot.as_ref()?)))
            .chain(
                self.stragglers
                    .iter()
                    .map(|(&seq, delivery)| (seq, delivery)),
            )
    }

    /// Every tracked delivery.
    pub fn values(&self) -> impl Iterator<Item = &Delivery> {
        self.iter().map(|(_, delivery)| delivery)
    }

    /// Stops tracking every delivery, handing them out.
    pub fn drain(&mut self) -> impl Iterator<Item = Delivery> + '_ {
        self.in_ring = 0;
        self.ring
            .drain(..)
            .flatten()
            .chain(self.stragglers.drain().map(|(_, delivery)| delivery))
    }

    fn index(&self, seq: u64) -> Option<usize> {
        usize::try_from(seq.checked_sub(self.base)?).ok()
    }

    /// Drops the settled slots at the ring's front, so it starts at a tracked delivery.
    fn pop_settled_front(&mut self) {
        while let Some(None) = self.ring.front() {
            self.ring.pop_front();
            self.base += 1;
        }
    }

    /// Moves front deliveries to the stragglers while the ring spans more than its bound.
    fn bound_span(&mut self) {
        let allowed = (self.in_ring * SPAN_PER_LIVE).max(MIN_SPAN);
        while self.ring.len() > allowed {
            if let Some(Some(delivery)) = self.ring.pop_front() {
                self.in_ring -= 1;
                self.stragglers.insert(self.base, delivery);
            }
            self.base += 1;
            self.pop_settled_front();
        }
    }

    /// Gives memory back once the ring holds a small part of what it grew to (a burst is
    /// over), so a group that was busy once does not keep its peak.
    fn release_spare_capacity(&mut self) {
        let wanted = self.ring.len().max(MIN_SPAN);
        if self.ring.capacity() > wanted * 8 {
            self.ring.shrink_to(wanted * 2);
        }
        if self.stragglers.is_empty() && self.stragglers.capacity() > MIN_SPAN {
            self.stragglers = FastMap::default();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn delivery(seq: u64) -> Delivery {
        Delivery::numbered(seq)
    }

    fn offset_of(tracked: &Tracked, seq: u64) -> Option<i64> {
        tracked.get(seq).map(|delivery| delivery.offset)
    }

    #[test]
    fn deliveries_are_found_by_sequence_number_until_removed_in_any_order() {
        let mut tracked = Tracked::default();
        for seq in 1..=100 {
            tracked.insert(seq, delivery(seq));
        }
        assert_eq!(tracked.len(), 100);
        for seq in (1..=100).filter(|seq| seq % 3 == 0) {
            assert_eq!(tracked.remove(seq).map(|d| d.offset), Some(seq as i64));
        }
        assert_eq!(tracked.remove(3).map(|d| d.offset), None, "removed once");
        assert_eq!(offset_of(&tracked, 1), Some(1));
        assert_eq!(offset_of(&tracked, 3), None);
        assert_eq!(offset_of(&tracked, 0), None);
        assert_eq!(offset_of(&tracked, 101), None);
        tracked.get_mut(50).unwrap().attempt = 7;
        assert_eq!(tracked.get(50).unwrap().attempt, 7);
        // The front goes: the ring starts at the first one still tracked.
        tracked.remove(1);
        tracked.remove(2);
        assert_eq!(tracked.base, 4);
        let seqs: Vec<u64> = tracked.iter().map(|(seq, _)| seq).collect();
        let expected: Vec<u64> = (4..=100).filter(|seq| seq % 3 != 0).collect();
        assert_eq!(seqs, expected);
        assert_eq!(tracked.len(), expected.len());
        assert_eq!(tracked.drain().count(), expected.len());
        assert!(tracked.is_empty());
        // After a drain, numbering goes on where it was.
        tracked.insert(200, delivery(200));
        assert_eq!(offset_of(&tracked, 200), Some(200));
        assert_eq!(tracked.len(), 1);
    }

    #[test]
    fn one_delivery_held_back_does_not_make_the_ring_span_everything_after_it() {
        let mut tracked = Tracked::default();
        tracked.insert(1, delivery(1)); // never settles
        let mut largest_ring = 0;
        for seq in 2..=100_000 {
            tracked.insert(seq, delivery(seq));
            // About a hundred in flight at a time, besides the held one.
            if seq > 101 {
                assert!(tracked.remove(seq - 100).is_some());
            }
            largest_ring = largest_ring.max(tracked.ring.len());
        }
        assert!(
            largest_ring <= MIN_SPAN + 1,
            "the ring spans at most {MIN_SPAN} slots with ~100 tracked, spanned {largest_ring}"
        );
        assert_eq!(tracked.stragglers.len(), 1, "only the held one moved aside");
        assert_eq!(offset_of(&tracked, 1), Some(1), "and it is still found");
        assert_eq!(tracked.len(), 101);
        assert!(tracked.get_mut(1).is_some());
        assert_eq!(tracked.remove(1).map(|d| d.offset), Some(1));
        assert_eq!(tracked.len(), 100);
        assert!(tracked.iter().all(|(seq, d)| d.offset == seq as i64));
    }

    #[test]
    fn a_burst_over_gives_its_memory_back() {
        let mut tracked = Tracked::default();
        for seq in 1..=200_000 {
            tracked.insert(seq, delivery(seq));
        }
        let peak = tracked.ring.capacity();
        assert!(peak >= 200_000);
        for seq in 1..=200_000 {
            tracked.remove(seq);
        }
        assert!(tracked.is_empty());
        assert!(
            tracked.ring.capacity() <= MIN_SPAN * 8,
            "capacity {} after the burst (peak {peak})",
            tracked.ring.capacity()
        );
    }
}
