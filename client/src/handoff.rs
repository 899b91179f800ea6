//! The hand-off of deliveries from a subscription's session task to the application.
//!
//! The session task gives whole batches (the deliveries of one server message) and the
//! application takes them one by one: one channel operation and one wake-up per message
//! instead of per delivery, and each delivery moves once on its way out instead of once per
//! queue it passed through.
//!
//! The bound is in deliveries, not batches: at most `capacity` deliveries wait between the two
//! sides (given and not yet taken by the application), however the server batches them. A
//! batch's room is taken before it is given ([`Giver::room`], which waits while the
//! application is behind) and comes back when the application has taken the batch's last
//! delivery. A batch larger than `capacity` must be split by the giver ([`Giver::capacity`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::{AcquireError, Semaphore, mpsc};

use crate::error::ClientError;

type Item<T> = Result<Vec<T>, ClientError>;

/// A hand-off of at most `capacity` waiting items (at least 1); deliveries in a subscription.
pub(crate) fn handoff<T>(capacity: usize) -> (Giver<T>, Taker<T>) {
    let capacity = capacity.clamp(1, Semaphore::MAX_PERMITS);
    let room = Arc::new(Semaphore::new(capacity));
    let (batches, rx) = mpsc::unbounded_channel();
    (
        Giver {
            batches,
            room: Arc::clone(&room),
            capacity,
        },
        Taker {
            batches: rx,
            room,
            current: Vec::new().into_iter(),
            owed: 0,
        },
    )
}

/// The session task's side.
#[derive(Debug)]
pub(crate) struct Giver<T> {
    batches: mpsc::UnboundedSender<Item<T>>,
    room: Arc<Semaphore>,
    capacity: usize,
}

/// Room taken for one batch of `len` deliveries; give the batch with it.
#[must_use]
pub(crate) struct Room<'a, T> {
    giver: &'a Giver<T>,
    len: usize,
}

impl<T> Clone for Giver<T> {
    fn clone(&self) -> Self {
        Giver {
            batches: self.batches.clone(),
            room: Arc::clone(&self.room),
            capacity: self.capacity,
        }
    }
}

impl<T> Giver<T> {
    /// Most deliveries one batch may hold.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Waits for room for `len` deliveries (`1 ..= capacity`); an error once the application
    /// side is gone. Cancel-safe: nothing is taken unless it returns.
    pub(crate) async fn room(&self, len: usize) -> Result<Room<'_, T>, AcquireError> {
        let len = len.clamp(1, self.capacity);
        // `len ≤ capacity ≤ MAX_PERMITS`, which fits a u32.
        let permits = self
            .room
            .acquire_many(u32::try_from(len).unwrap_or(u32::MAX))
            .await?;
        // Given back by the taker, when the application has taken the batch.
        permits.forget();
        Ok(Room { giver: self, len })
    }

    /// Tells the application the subscription cannot go on (takes no room: it is the last
    /// item).
    pub(crate) fn fail(&self, error: ClientError) {
        let _ = self.batches.send(Err(error));
    }
}

impl<T> Room<'_, T> {
    /// Gives `batch`, which must hold the number of deliveries the room was taken for (a
    /// shorter one gives the difference back).
    pub(crate) fn give(self, batch: Vec<T>) {
        debug_assert!(batch.len() <= self.len, "a batch larger than its room");
        let unused = self.len.saturating_sub(batch.len());
        if unused > 0 {
            self.giver.room.add_permits(unused);
        }
        if batch.is_empty() {
            return;
        }
        if let Err(mpsc::error::SendError(Ok(batch))) = self.giver.batches.send(Ok(batch)) {
            // The application is gone; the room no longer matters, but keep the count true.
            self.giver.room.add_permits(batch.len());
        }
    }
}

/// The application's side.
#[derive(Debug)]
pub(crate) struct Taker<T> {
    batches: mpsc::UnboundedReceiver<Item<T>>,
    room: Arc<Semaphore>,
    current: std::vec::IntoIter<T>,
    /// Room held by `current`, given back with its last delivery.
    owed: usize,
}

impl<T> Taker<T> {
    /// The next delivery; `None` once the giver is gone and everything was taken.
    pub(crate) fn poll_take(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<T, ClientError>>> {
        loop {
            if let Some(item) = self.current.next() {
                if self.current.len() == 0 {
                    self.room.add_permits(std::mem::take(&mut self.owed));
                }
                return Poll::Ready(Some(Ok(item)));
            }
            match self.batches.poll_recv(cx) {
                Poll::Ready(Some(Ok(batch))) => {
                    self.owed = batch.len();
                    self.current = batch.into_iter();
                }
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
        self.room.close();
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
    async fn the_bound_counts_items_and_room_comes_back_with_a_batchs_last_item() {
        let (giver, mut taker) = handoff::<u32>(4);
        giver.room(3).await.unwrap().give(vec![1, 2, 3]);
        // One slot left: a batch of two waits.
        let waiting = tokio::time::timeout(Duration::from_millis(50), giver.room(2)).await;
        assert!(waiting.is_err(), "room for 5 items in a hand-off of 4");
        giver.room(1).await.unwrap().give(vec![4]);
        // Taking part of the first batch gives nothing back yet...
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 1);
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 2);
        let waiting = tokio::time::timeout(Duration::from_millis(50), giver.room(1)).await;
        assert!(
            waiting.is_err(),
            "room came back before the batch was taken"
        );
        // ...its last item gives back all three.
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 3);
        tokio::time::timeout(Duration::from_secs(5), giver.room(3))
            .await
            .unwrap()
            .unwrap()
            .give(vec![5, 6, 7]);
        for expected in [4, 5, 6, 7] {
            assert_eq!(take(&mut taker).await.unwrap().unwrap(), expected);
        }
    }

    #[tokio::test]
    async fn a_short_batch_gives_its_unused_room_back() {
        let (giver, mut taker) = handoff::<u32>(2);
        giver.room(2).await.unwrap().give(vec![1]);
        // The second slot was never used.
        tokio::time::timeout(Duration::from_secs(5), giver.room(1))
            .await
            .unwrap()
            .unwrap()
            .give(vec![2]);
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 1);
        assert_eq!(take(&mut taker).await.unwrap().unwrap(), 2);
    }

    #[tokio::test]
    async fn a_giver_waiting_for_room_learns_the_taker_is_gone() {
        let (giver, taker) = handoff::<u32>(1);
        giver.room(1).await.unwrap().give(vec![1]);
        let waiting = tokio::spawn({
            let giver = giver.clone();
            async move { giver.room(1).await.is_err() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
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
