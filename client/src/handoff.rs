//! The hand-off of deliveries from a subscription's session task to the application.
//!
//! The session task gives whole batches (the deliveries of one server message) and the
//! application takes them one by one: one channel operation and one wake-up per message
//! instead of per delivery, and each delivery moves once on its way out instead of once per
//! queue it passed through.
//!
//! The bound is in deliveries, not batches: at most `capacity` deliveries wait between the two
//! sides (given and not yet taken by the application), however the server batches them. The
//! giver waits for room before it gives ([`Giver::room`]); every delivery the application takes
//! makes room for one more at once — not when the rest of its batch is taken too, or an
//! application that takes one delivery and waits for its ACK's answer would wait for ever: the
//! server sends the next delivery as soon as the ACK frees its credit, the task must give it
//! before it reads the stream again, and the answer is behind it in the stream. A batch larger
//! than `capacity` must be split by the giver ([`Giver::capacity`], [`split_into`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::sync::{Notify, mpsc};

use crate::error::ClientError;

type Item<T> = Result<Vec<T>, ClientError>;

/// The count both sides keep: how many were given and taken, and whether either side waits or
/// is gone.
#[derive(Debug)]
struct Counts {
    capacity: u64,
    given: AtomicU64,
    taken: AtomicU64,
    /// The giver waits for room (the taker then wakes it with every delivery it takes).
    giver_waits: AtomicBool,
    /// The taker is gone: nobody will make room again.
    taker_gone: AtomicBool,
    room_made: Notify,
}

impl Counts {
    fn has_room_for(&self, len: u64) -> bool {
        // SeqCst pairs with the taker's: either the giver sees the take, or the taker sees the
        // giver waiting and wakes it.
        let waiting = self.given.load(Ordering::SeqCst) - self.taken.load(Ordering::SeqCst);
        waiting + len <= self.capacity
    }
}

/// A hand-off of at most `capacity` waiting items (at least 1); deliveries in a subscription.
pub(crate) fn handoff<T>(capacity: usize) -> (Giver<T>, Taker<T>) {
    let counts = Arc::new(Counts {
        capacity: capacity.max(1) as u64,
        given: AtomicU64::new(0),
        taken: AtomicU64::new(0),
        giver_waits: AtomicBool::new(false),
        taker_gone: AtomicBool::new(false),
        room_made: Notify::new(),
    });
    let (batches, rx) = mpsc::unbounded_channel();
    (
        Giver {
            batches,
            counts: Arc::clone(&counts),
        },
        Taker {
            batches: rx,
            counts,
            current: Vec::new().into_iter(),
        },
    )
}

/// The session task's side.
#[derive(Debug)]
pub(crate) struct Giver<T> {
    batches: mpsc::UnboundedSender<Item<T>>,
    counts: Arc<Counts>,
}

/// The application side is gone: nothing given will be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TakerGone;

/// Room for one batch; give it with [`Room::give`].
#[must_use]
pub(crate) struct Room<'a, T> {
    giver: &'a Giver<T>,
    len: usize,
}

impl<T> Clone for Giver<T> {
    fn clone(&self) -> Self {
        Giver {
            batches: self.batches.clone(),
            counts: Arc::clone(&self.counts),
        }
    }
}

impl<T> Giver<T> {
    /// Most deliveries one batch may hold.
    pub(crate) fn capacity(&self) -> usize {
        usize::try_from(self.counts.capacity).unwrap_or(usize::MAX)
    }

    /// Waits until `len` more deliveries (`1 ..= capacity`) fit. Cancel-safe: it takes
    /// nothing; the room is counted when the batch is given (there is one giver at a time).
    pub(crate) async fn room(&self, len: usize) -> Result<Room<'_, T>, TakerGone> {
        let len = len.clamp(1, self.capacity());
        let counts = &self.counts;
        loop {
            if counts.taker_gone.load(Ordering::SeqCst) {
                return Err(TakerGone);
            }
            if counts.has_room_for(len as u64) {
                return Ok(Room { giver: self, len });
            }
            counts.giver_waits.store(true, Ordering::SeqCst);
            // Checked again after saying so: a take in between either shows here or wakes us
            // (a wake-up with nobody waiting yet is kept for the next wait).
            if counts.has_room_for(len as u64) || counts.taker_gone.load(Ordering::SeqCst) {
                counts.giver_waits.store(false, Ordering::SeqCst);
                continue;
            }
            counts.room_made.notified().await;
            counts.giver_waits.store(false, Ordering::SeqCst);
        }
    }

    /// Tells the application the subscription cannot go on (takes no room: it is the last
    /// item).
    pub(crate) fn fail(&self, error: ClientError) {
        let _ = self.batches.send(Err(error));
    }
}

impl<T> Room<'_, T> {
    /// Gives `batch`, at most the number of deliveries the room was found for.
    pub(crate) fn give(self, batch: Vec<T>) {
        debug_assert!(batch.len() <= self.len, "a batch larger than its room");
        if batch.is_empty() {
            return;
        }
        let counts = &self.giver.counts;
        counts.given.fetch_add(batch.len() as u64, Ordering::SeqCst);
        // The application may be gone; then nothing waits for room any more.
        let _ = self.giver.batches.send(Ok(batch));
    }
}

/// The application's side.
#[derive(Debug)]
pub(crate) struct Taker<T> {
    batches: mpsc::UnboundedReceiver<Item<T>>,
    counts: Arc<Counts>,
    current: std::vec::IntoIter<T>,
}

impl<T> Taker<T> {
    /// The next delivery; `None` once the giver is gone and everything was taken.
    pub(crate) fn poll_take(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<T, ClientError>>> {
        loop {
            if let Some(item) = self.current.next() {
                let counts = &self.counts;
                counts.taken.fetch_add(1, Ordering::SeqCst);
                if counts.giver_waits.load(Ordering::SeqCst) {
                    counts.room_made.notify_one();
                }
                return Poll::Ready(Some(Ok(item)));
            }
            match self.batches.poll_recv(cx) {
                Poll::Ready(Some(Ok(batch))) => self.current = batch.into_iter(),
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<T> Drop for Taker<T> {
    fn drop(&mut self) {
        // A giver waiting for room learns that nobody will take.
        self.counts.taker_gone.store(true, Ordering::SeqCst);
        self.counts.room_made.notify_one();
    }
}

/// Splits `items` into batches of at most `capacity` each, appended to `held` in order.
pub(crate) fn split_into<T>(held: &mut VecDeque<Vec<T>>, mut items: Vec<T>, capacity: usize) {
    while items.len() > capacity {
        let rest = items.split_off(capacity);
        held.push_back(items);
        items = rest;
    }
    if !items.is_empty() {
        held.push_back(items);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::future::poll_fn;
    use std::time::Duration;

    use super::*;

    async fn take<T>(taker: &mut Taker<T>) -> Option<Result<T, ClientError>> {
        poll_fn(|cx| taker.poll_take(cx)).await
    }

    #[tokio::test]
    async fn batches_come_out_one_by_one_in_order() {
        let (giver, mut taker) = handoff::<u32>(8);
        giver.room(3).await.unwrap().give(vec![1, 2, 3]);
        giver.room(2).await.unwrap().give(vec![4, 5]);
        drop(giver);
        let mut taken = Vec::new();
        while let Some(item) = take(&mut taker).await {
            taken.push(item.unwrap());
        }
        assert_eq!(taken, vec![1, 2, 3, 4, 5]);
    }

    #[tokio::test]
    async fn the_bound_counts_items_and_each_item_taken_makes_room_for_one() {
        let (giver, mut taker) = handoff::<u32>(4);
        giver.room(3).await.unwrap().give(vec![1, 2, 3]);
        // One slot left: a batch of two waits.
        let waiting = tokio::time::timeout(Duration::from_millis(50), giver.room(2)).await;
        assert!(waiting.is_err(), "room for 5 items in a hand-off of 4");
        giver.room(1).await.unwrap().give(vec![4]);
        let waiting = tokio::time::timeout(Duration::from_millis(50), giver.room(1)).await;
        assert!(waiting.is_err(), "room for 5 items in a hand-off of 4");
        // Taking one item of a batch, the rest of it still waiting, makes room for one.
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 1);
        tokio::time::timeout(Duration::from_secs(5), giver.room(1))
            .await
            .unwrap()
            .unwrap()
            .give(vec![5]);
        let waiting = tokio::time::timeout(Duration::from_millis(50), giver.room(1)).await;
        assert!(waiting.is_err(), "room for 5 items in a hand-off of 4");
        for expected in [2, 3, 4, 5] {
            assert_eq!(take(&mut taker).await.unwrap().unwrap(), expected);
        }
        tokio::time::timeout(Duration::from_secs(5), giver.room(4))
            .await
            .unwrap()
            .unwrap()
            .give(vec![6, 7, 8, 9]);
    }

    /// An application that takes one delivery and waits for its ACK's answer before taking
    /// the next: the server's next delivery (sent when the ACK freed its credit) must fit
    /// while the rest of the first batch is still untaken, or the answer behind it in the
    /// stream is never read.
    #[tokio::test]
    async fn a_giver_waiting_for_room_is_woken_by_a_single_take() {
        let (giver, mut taker) = handoff::<u32>(4);
        giver.room(4).await.unwrap().give(vec![1, 2, 3, 4]);
        let next = tokio::spawn({
            let giver = giver.clone();
            async move {
                giver.room(1).await.unwrap().give(vec![5]);
            }
        });
        // The giver is waiting before the take.
        while !giver.counts.giver_waits.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 1);
        tokio::time::timeout(Duration::from_secs(5), next)
            .await
            .expect("a take wakes the waiting giver")
            .unwrap();
        for expected in [2, 3, 4, 5] {
            assert_eq!(take(&mut taker).await.unwrap().unwrap(), expected);
        }
    }

    #[tokio::test]
    async fn a_giver_waiting_for_room_learns_the_taker_is_gone() {
        let (giver, taker) = handoff::<u32>(1);
        giver.room(1).await.unwrap().give(vec![1]);
        let waiting = tokio::spawn({
            let giver = giver.clone();
            async move { giver.room(1).await.is_err() }
        });
        while !giver.counts.giver_waits.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(taker);
        assert!(
            tokio::time::timeout(Duration::from_secs(5), waiting)
                .await
                .unwrap()
                .unwrap()
        );
    }

    #[tokio::test]
    async fn a_failure_arrives_after_what_was_given() {
        let (giver, mut taker) = handoff::<u32>(4);
        giver.room(1).await.unwrap().give(vec![1]);
        giver.fail(ClientError::Closed);
        drop(giver);
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 1);
        assert!(matches!(
            take(&mut taker).await,
            Some(Err(ClientError::Closed))
        ));
        assert!(take(&mut taker).await.is_none());
    }

    #[test]
    fn batches_are_split_to_the_capacity_in_order() {
        let mut held = VecDeque::new();
        split_into(&mut held, (1..=7).collect(), 3);
        split_into(&mut held, Vec::new(), 3);
        split_into(&mut held, vec![8], 3);
        let held: Vec<Vec<u32>> = held.into_iter().collect();
        assert_eq!(held, vec![vec![1, 2, 3], vec![4, 5, 6], vec![7], vec![8]]);
    }
}
