//! The gap-free watermarks (DESIGN §4): what may be written to offset-svc.
//!
//! [`GroupWatermark`] tracks one subscription group in one MQ partition. Its value `W` is
//! inclusive: every MQ offset `≤ W` is **settled** — ACKed, dead-lettered durably, or never
//! needing a delivery (an offset the MQ skipped inside a pulled `[first, next)` range). It only
//! moves up, and only over a contiguous settled prefix, so a crash after out-of-order ACKs never
//! skips an un-ACKed lower offset: the reference wrote the *maximum* ACKed offset instead (its
//! loss path L1), which this type exists to avoid.
//!
//! The tracker is seeded with the stored watermark, so frames `≤ W` that the puller hands over
//! again are recognised as settled, and it remembers which offsets above `W` it has already
//! admitted, so a re-pulled frame (after a puller restart or realignment) is not delivered a
//! second time.
//!
//! [`ClientWatermark`] is the same rule over one client's own deliveries in one partition: the
//! highest offset such that every delivery this client received at or below it is settled.

use std::collections::{BTreeSet, VecDeque};

/// What to do with a pulled record, according to the group's tracker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// New: deliver it (it is now tracked as unsettled).
    Deliver,
    /// At or below the watermark: settled before; drop it.
    BelowWatermark,
    /// Already admitted and still unsettled: being delivered; drop the copy.
    InFlight,
    /// Already admitted and settled above the watermark; drop it.
    SettledAbove,
}

/// One group's gap-free watermark in one partition.
///
/// Admitted offsets are kept in a queue in ascending order — admission only ever appends, as
/// each admitted offset is above the cover and so above every earlier one — each marked when
/// it settles: appending and settling in order (nearly always) are O(1), any settle is a
/// binary search. The front is always unsettled (settled ones are popped as it moves), and
/// settled entries further in are compacted away once they outnumber the unsettled ones, so
/// memory stays proportional to what is unsettled however long one offset stays so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupWatermark {
    watermark: i64,
    /// One past the highest offset any pulled range covered.
    covered_next: i64,
    /// Admitted offsets above the watermark, ascending, with whether each has settled.
    admitted: VecDeque<(i64, bool)>,
    /// Entries of `admitted` not settled.
    unsettled: usize,
}

impl GroupWatermark {
    /// A tracker whose every offset `≤ seed` is settled (`-1`: nothing is).
    pub fn new(seed: i64) -> Self {
        let seed = seed.max(-1);
        GroupWatermark {
            watermark: seed,
            covered_next: seed + 1,
            admitted: VecDeque::new(),
            unsettled: 0,
        }
    }

    /// The inclusive watermark `W`; `-1` when nothing is settled.
    pub fn watermark(&self) -> i64 {
        self.watermark
    }

    /// Offsets admitted and not yet settled.
    pub fn unsettled(&self) -> usize {
        self.unsettled
    }

    /// Where `offset` is in the admitted queue.
    fn find(&self, offset: i64) -> Option<usize> {
        // A partition's offsets are mostly consecutive, so first look where it would be if
        // they were: one probe instead of a search over thousands of entries.
        let front = self.admitted.front()?.0;
        if let Ok(guess) = usize::try_from(offset - front)
            && self
                .admitted
                .get(guess)
                .is_some_and(|(at, _)| *at == offset)
        {
            return Some(guess);
        }
        self.admitted
            .binary_search_by_key(&offset, |(admitted, _)| *admitted)
            .ok()
    }

    /// Classifies a pulled record; a [`Admission::Deliver`] record is tracked from now on.
    /// Call it for a batch's records before [`GroupWatermark::cover`] for its range.
    pub fn admit(&mut self, offset: i64) -> Admission {
        if offset <= self.watermark {
            Admission::BelowWatermark
        } else if offset >= self.covered_next {
            self.admitted.push_back((offset, false));
            self.unsettled += 1;
            // Records of a batch arrive before its range: keep the cover ahead of them so a
            // duplicate inside the same batch is recognised.
            self.covered_next = offset + 1;
            Admission::Deliver
        } else if self.find(offset).is_some_and(|at| !self.admitted[at].1) {
            Admission::InFlight
        } else {
            Admission::SettledAbove
        }
    }

    /// Records that a pull covered a range `[first, next)`: offsets below `next` that were not
    /// admitted were skipped by the MQ (a range may also start above the cover, when the MQ
    /// skipped more) and count as settled. Returns the new watermark if it moved.
    pub fn cover(&mut self, next: i64) -> Option<i64> {
        if next > self.covered_next {
            self.covered_next = next;
        }
        self.recompute()
    }

    /// Settles an admitted offset. Returns the new watermark if it moved.
    pub fn settle(&mut self, offset: i64) -> Option<i64> {
        let at = self.find(offset)?;
        let entry = &mut self.admitted[at];
        if entry.1 {
            return None;
        }
        entry.1 = true;
        self.unsettled -= 1;
        while self.admitted.front().is_some_and(|(_, settled)| *settled) {
            self.admitted.pop_front();
        }
        if self.admitted.len() > 2 * self.unsettled + 64 {
            self.admitted.retain(|(_, settled)| !settled);
        }
        self.recompute()
    }

    fn recompute(&mut self) -> Option<i64> {
        let next = match self.admitted.front() {
            Some((lowest, _)) => lowest - 1,
            None => self.covered_next - 1,
        };
        (next > self.watermark).then(|| {
            self.watermark = next;
            next
        })
    }
}

/// One client's watermark over its own deliveries in one partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientWatermark {
    outstanding: BTreeSet<i64>,
    max_settled: Option<i64>,
}

impl ClientWatermark {
    /// Records that a delivery at `offset` was sent to this client.
    pub fn sent(&mut self, offset: i64) {
        self.outstanding.insert(offset);
    }

    /// Settles a delivery of this client at `offset`.
    pub fn settle(&mut self, offset: i64) {
        if self.outstanding.remove(&offset) {
            self.max_settled = Some(self.max_settled.map_or(offset, |m| m.max(offset)));
        }
    }

    /// Forgets an outstanding delivery without settling it (the group ended and its copy will
    /// be pulled again).
    pub fn forget(&mut self, offset: i64) {
        self.outstanding.remove(&offset);
    }

    /// The watermark to store, if any delivery of this client has settled: every delivery of
    /// this client at or below it is settled.
    pub fn watermark(&self) -> Option<i64> {
        let settled = self.max_settled?;
        let value = match self.outstanding.first() {
            Some(lowest) => settled.min(lowest - 1),
            None => settled,
        };
        (value >= 0).then_some(value)
    }

    /// Whether the client has nothing outstanding here.
    pub fn is_idle(&self) -> bool {
        self.outstanding.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tracker at W = 99 that has admitted `offsets` from one range `[100, next)`.
    fn tracker_with(offsets: &[i64], next: i64) -> GroupWatermark {
        let mut tracker = GroupWatermark::new(99);
        for offset in offsets {
            assert_eq!(tracker.admit(*offset), Admission::Deliver);
        }
        tracker.cover(next);
        tracker
    }

    // Reference MqCursorRecordingTest, adapted: ACK 100 then 200 with nothing else outstanding
    // (the offsets between were skipped by the MQ) gives 200.
    #[test]
    fn in_order_acks_move_to_the_highest() {
        let mut tracker = tracker_with(&[100, 200], 201);
        assert_eq!(tracker.watermark(), 99);
        assert_eq!(
            tracker.settle(100),
            Some(199),
            "101..199 were skipped: settled"
        );
        assert_eq!(tracker.settle(200), Some(200));
    }

    // ACKing 200 while 100 is still in flight leaves the watermark at 99 (the reference would
    // have written 200 and lost 100 after a crash: L1).
    #[test]
    fn out_of_order_ack_holds_the_watermark() {
        let mut tracker = tracker_with(&[100, 200], 201);
        assert_eq!(tracker.settle(200), None);
        assert_eq!(tracker.watermark(), 99);
        assert_eq!(tracker.settle(100), Some(200));
    }

    #[test]
    fn every_permutation_of_acks_ends_at_the_top_and_never_passes_a_gap() {
        let offsets = [10_i64, 11, 12, 13, 14];
        let mut order = offsets.to_vec();
        // All 120 permutations, by Heap's algorithm.
        let mut c = [0usize; 5];
        let check = |order: &[i64]| {
            let mut tracker = GroupWatermark::new(9);
            for o in offsets {
                tracker.admit(o);
            }
            tracker.cover(15);
            let mut settled = BTreeSet::new();
            for o in order {
                tracker.settle(*o);
                settled.insert(*o);
                let w = tracker.watermark();
                assert!((10..=w).all(|x| settled.contains(&x)), "{order:?}: W={w}");
            }
            assert_eq!(tracker.watermark(), 14);
        };
        check(&order);
        let mut i = 0;
        while i < 5 {
            if c[i] < i {
                if i % 2 == 0 {
                    order.swap(0, i);
                } else {
                    order.swap(c[i], i);
                }
                check(&order);
                c[i] += 1;
                i = 0;
            } else {
                c[i] = 0;
                i += 1;
            }
        }
    }

    #[test]
    fn frames_below_or_tracked_are_not_delivered_twice() {
        let mut tracker = tracker_with(&[100, 101, 102], 103);
        tracker.settle(101);
        // A realigned puller hands 95..=102 over again.
        assert_eq!(tracker.admit(95), Admission::BelowWatermark);
        assert_eq!(tracker.admit(99), Admission::BelowWatermark);
        assert_eq!(tracker.admit(100), Admission::InFlight);
        assert_eq!(tracker.admit(101), Admission::SettledAbove);
        assert_eq!(tracker.admit(102), Admission::InFlight);
        assert_eq!(tracker.cover(103), None);
        assert_eq!(tracker.admit(103), Admission::Deliver);
        assert_eq!(
            tracker.admit(103),
            Admission::InFlight,
            "a duplicate inside one batch"
        );
    }

    #[test]
    fn empty_and_skipping_ranges_settle() {
        let mut tracker = GroupWatermark::new(-1);
        assert_eq!(tracker.cover(5), Some(4), "nothing admitted: all skipped");
        assert_eq!(tracker.admit(7), Admission::Deliver);
        assert_eq!(tracker.cover(10), Some(6), "5, 6 skipped; 7 unsettled");
        assert_eq!(tracker.settle(7), Some(9));
        assert_eq!(tracker.settle(7), None, "a second settle changes nothing");
        assert_eq!(tracker.settle(1_000), None, "never admitted");
    }

    /// One offset left unsettled while thousands after it settle out of order: the tracker
    /// keeps only a bounded number of settled entries, and every answer stays right.
    #[test]
    fn one_stuck_offset_keeps_memory_bounded_and_answers_right() {
        let mut tracker = GroupWatermark::new(-1);
        for offset in 0..10_000 {
            assert_eq!(tracker.admit(offset), Admission::Deliver);
        }
        tracker.cover(10_000);
        // Settle everything but 0, odd offsets first, then even ones from the top down.
        let order = (1..10_000)
            .filter(|o| o % 2 == 1)
            .chain((1..10_000).rev().filter(|o| o % 2 == 0));
        for offset in order {
            assert_eq!(tracker.settle(offset), None, "0 holds the watermark");
            assert!(
                tracker.admitted.len() <= 2 * tracker.unsettled() + 65,
                "{} entries for {} unsettled",
                tracker.admitted.len(),
                tracker.unsettled()
            );
        }
        assert_eq!(tracker.unsettled(), 1);
        assert_eq!(tracker.admit(0), Admission::InFlight);
        assert_eq!(tracker.admit(5_000), Admission::SettledAbove);
        assert_eq!(tracker.settle(5_000), None, "settled already");
        assert_eq!(tracker.admit(10_000), Admission::Deliver);
        assert_eq!(tracker.settle(0), Some(9_999));
        assert_eq!(tracker.settle(10_000), Some(10_000));
        assert_eq!(tracker.unsettled(), 0);
    }

    /// The rule, as plainly as it can be said: an ordered set of unsettled offsets.
    struct Model {
        watermark: i64,
        covered_next: i64,
        unsettled: BTreeSet<i64>,
    }

    impl Model {
        fn admit(&mut self, offset: i64) -> Admission {
            if offset <= self.watermark {
                Admission::BelowWatermark
            } else if offset >= self.covered_next {
                self.unsettled.insert(offset);
                self.covered_next = offset + 1;
                Admission::Deliver
            } else if self.unsettled.contains(&offset) {
                Admission::InFlight
            } else {
                Admission::SettledAbove
            }
        }

        fn recompute(&mut self) -> Option<i64> {
            let next = self
                .unsettled
                .first()
                .map_or(self.covered_next - 1, |lowest| lowest - 1);
            (next > self.watermark).then(|| {
                self.watermark = next;
                next
            })
        }
    }

    proptest::proptest! {
        /// Random admissions, covers and settles (repeats and strays included) answer as the
        /// plain model does, step by step.
        #[test]
        fn the_queue_answers_as_an_ordered_set(
            steps in proptest::collection::vec((0u8..3, 0i64..300), 1..600)
        ) {
            let mut tracker = GroupWatermark::new(-1);
            let mut model = Model { watermark: -1, covered_next: 0, unsettled: BTreeSet::new() };
            for (kind, offset) in steps {
                match kind {
                    0 => proptest::prop_assert_eq!(tracker.admit(offset), model.admit(offset)),
                    1 => {
                        if offset > model.covered_next {
                            model.covered_next = offset;
                        }
                        proptest::prop_assert_eq!(tracker.cover(offset), model.recompute());
                    }
                    _ => {
                        let expected = model.unsettled.remove(&offset).then(|| model.recompute()).flatten();
                        proptest::prop_assert_eq!(tracker.settle(offset), expected);
                    }
                }
                proptest::prop_assert_eq!(tracker.watermark(), model.watermark);
                proptest::prop_assert_eq!(tracker.unsettled(), model.unsettled.len());
            }
        }
    }

    #[test]
    fn seed_minus_one_starts_at_zero() {
        let mut tracker = GroupWatermark::new(-1);
        assert_eq!(tracker.admit(0), Admission::Deliver);
        assert_eq!(tracker.watermark(), -1);
        assert_eq!(tracker.settle(0), Some(0));
    }

    #[test]
    fn client_watermark_covers_only_its_own_deliveries() {
        let mut client = ClientWatermark::default();
        assert_eq!(client.watermark(), None);
        client.sent(5);
        client.sent(9);
        client.settle(9);
        assert_eq!(client.watermark(), Some(4), "5 is outstanding");
        client.settle(5);
        assert_eq!(client.watermark(), Some(9));
        client.sent(20);
        assert_eq!(client.watermark(), Some(9));
        client.forget(20);
        assert!(client.is_idle());
        client.settle(0);
        assert_eq!(client.watermark(), Some(9), "never sent: ignored");
    }
}
