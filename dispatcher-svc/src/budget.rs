//! The per-topic buffer bound (DESIGN §7 flow control).
//!
//! Every pulled record a dispatcher holds — queued, in flight, awaiting its offset write — is
//! charged to its topic's budget, in records and in KiB (at least 1 KiB per record), until it is
//! retired. A group's pull loop reserves budget before each pull and sizes the pull to it, so
//! back-pressure reaches the MQ, not memory.
//!
//! **Fair shares.** Each group of the topic ([`TopicBudget::join`]) may hold at most its share,
//! the budget divided by the number of groups, so one stuck group (a client that never ACKs or
//! never reads) pauses only itself: the topic's other groups keep their shares. A group above
//! its share (a new group joined) waits until it is below again. While the whole budget is
//! spent, the group holding the most records is reported as the one governing
//! (`dispatcher_topic_buffer_full{topic, group}` = 1 and [`TopicBudget::governing_group`]),
//! so an operator sees which subscriber is slow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use eventmesh_common::metrics::{KeptGauge, group_label};
use metrics::Label;
use tokio::sync::{Notify, Semaphore};

/// KiB charged for a record of `bytes`.
pub fn kib_cost(bytes: usize) -> u32 {
    (bytes.div_ceil(1024).max(1)).min(u32::MAX as usize) as u32
}

/// Records and KiB reserved for one pull, or held by records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    /// Records.
    pub records: u32,
    /// KiB.
    pub kib: u32,
}

impl std::ops::AddAssign for Charge {
    fn add_assign(&mut self, other: Charge) {
        self.records += other.records;
        self.kib += other.kib;
    }
}

/// One topic's buffer budget, shared by its groups.
#[derive(Debug)]
pub struct TopicBudget {
    topic: String,
    total: Charge,
    records: Semaphore,
    kib: Semaphore,
    held: Mutex<HashMap<String, Held>>,
    /// Groups of the topic, each with the signal its reservation waits on for room.
    members: Mutex<HashMap<String, Arc<Notify>>>,
    governing: Mutex<Option<String>>,
}

/// What one group holds, with its gauge (made once per group: every delivery's release
/// updates it).
#[derive(Debug)]
struct Held {
    charge: Charge,
    gauge: KeptGauge,
}

impl TopicBudget {
    /// A budget of `records` records and `kib` KiB.
    pub fn new(topic: &str, records: u32, kib: u32) -> Arc<Self> {
        Arc::new(TopicBudget {
            topic: topic.to_owned(),
            total: Charge { records, kib },
            records: Semaphore::new(records as usize),
            kib: Semaphore::new(kib as usize),
            held: Mutex::default(),
            members: Mutex::default(),
            governing: Mutex::default(),
        })
    }

    /// A group of the topic starts: the shares shrink.
    pub fn join(&self, group: &str) {
        self.lock_members()
            .entry(group.to_owned())
            .or_insert_with(|| Arc::new(Notify::new()));
    }

    /// A group of the topic ended: the others' shares grow.
    pub fn leave(&self, group: &str) {
        {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            if held
                .get(group)
                .is_some_and(|h| h.charge == Charge::default())
            {
                held.remove(group);
            }
        }
        let mut members = self.lock_members();
        members.remove(group);
        for signal in members.values() {
            signal.notify_one();
        }
    }

    /// No group is a member and nothing is held.
    pub fn is_unused(&self) -> bool {
        // One lock at a time (adjust_held takes `held`, then `members`).
        let no_members = self.lock_members().is_empty();
        no_members
            && self
                .held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .all(|h| h.charge == Charge::default())
    }

    /// What one group may hold: the budget divided by the topic's groups.
    pub fn share(&self) -> Charge {
        let groups = self.lock_members().len().max(1) as u32;
        Charge {
            records: self.total.records.div_ceil(groups).max(1),
            kib: self.total.kib.div_ceil(groups).max(1),
        }
    }

    fn lock_members(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Room left in `group`'s share, and the signal to wait on when there is none.
    fn room(&self, group: &str) -> (Charge, Option<Arc<Notify>>) {
        let share = self.share();
        let held = self.held_by(group);
        let room = Charge {
            records: share.records.saturating_sub(held.records),
            kib: share.kib.saturating_sub(held.kib),
        };
        (room, self.lock_members().get(group).cloned())
    }

    /// Reserves up to `records` records and `kib` KiB for a pull by `group`, within its share,
    /// waiting until at least one record and one KiB are free (in the share and the topic).
    pub async fn reserve(&self, group: &str, records: u32, kib: u32) -> Charge {
        let (records, kib) = loop {
            let (room, signal) = self.room(group);
            if room.records > 0 && room.kib > 0 {
                break (records.min(room.records), kib.min(room.kib));
            }
            match signal {
                Some(signal) => signal.notified().await,
                // Not a member (never joined): only the topic bound applies.
                None => break (records, kib),
            }
        };
        let first = match self.records.try_acquire() {
            Ok(permit) => permit,
            Err(_) => {
                self.mark_full();
                match self.records.acquire().await {
                    Ok(permit) => permit,
                    // The semaphore is never closed.
                    Err(_) => return Charge::default(),
                }
            }
        };
        first.forget();
        let records = 1 + take_up_to(&self.records, records.saturating_sub(1));
        let kib_first = match self.kib.acquire().await {
            Ok(permit) => permit,
            Err(_) => return Charge::default(),
        };
        kib_first.forget();
        let charge = Charge {
            records,
            kib: 1 + take_up_to(&self.kib, kib.saturating_sub(1)),
        };
        self.adjust_held(group, charge, true);
        charge
    }

    /// Charges `group` more after a pull returned more bytes than reserved (at least one record
    /// always comes back); waits until the KiB are free.
    pub async fn charge_more_kib(&self, group: &str, kib: u32) {
        if kib == 0 {
            return;
        }
        if let Ok(permits) = self.kib.acquire_many(kib).await {
            permits.forget();
        }
        self.adjust_held(group, Charge { records: 0, kib }, true);
    }

    /// Returns budget held by `group`.
    pub fn release(&self, group: &str, charge: Charge) {
        self.adjust_held(group, charge, false);
        self.records.add_permits(charge.records as usize);
        self.kib.add_permits(charge.kib as usize);
        if let Some(signal) = self.lock_members().get(group) {
            signal.notify_one();
        }
        self.mark_flowing();
    }

    /// What `group` holds now.
    pub fn held_by(&self, group: &str) -> Charge {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(group)
            .map(|h| h.charge)
            .unwrap_or_default()
    }

    /// While the budget is spent: the group holding the most records.
    pub fn governing_group(&self) -> Option<String> {
        self.governing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Hot path (every pull and every retired delivery): a group's entry stays while it is a
    /// member, even at zero, so nothing is allocated per call.
    fn adjust_held(&self, group: &str, charge: Charge, add: bool) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if !held.contains_key(group) {
            let gauge = KeptGauge::gauge(
                "dispatcher_buffered_records",
                vec![
                    Label::new("topic", self.topic.clone()),
                    Label::new("group", group_label(group)),
                ],
            );
            held.insert(
                group.to_owned(),
                Held {
                    charge: Charge::default(),
                    gauge,
                },
            );
        }
        let Some(slot) = held.get_mut(group) else {
            return;
        };
        if add {
            slot.charge += charge;
        } else {
            slot.charge.records = slot.charge.records.saturating_sub(charge.records);
            slot.charge.kib = slot.charge.kib.saturating_sub(charge.kib);
        }
        slot.gauge.set(f64::from(slot.charge.records));
        if slot.charge == Charge::default() && !self.lock_members().contains_key(group) {
            held.remove(group);
        }
    }

    fn mark_full(&self) {
        let slowest = {
            let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            held.iter()
                .filter(|(_, held)| held.charge.records > 0)
                .max_by_key(|(name, held)| {
                    (held.charge.records, std::cmp::Reverse((*name).clone()))
                })
                .map(|(name, _)| name.clone())
        };
        let mut governing = self.governing.lock().unwrap_or_else(|p| p.into_inner());
        if *governing != slowest {
            if let Some(old) = governing.take() {
                metrics::gauge!("dispatcher_topic_buffer_full", "topic" => self.topic.clone(), "group" => group_label(&old)).set(0.0);
            }
            if let Some(group) = &slowest {
                tracing::warn!(
                    topic = self.topic,
                    group,
                    "topic buffer full: pulling paused; this group holds the most un-ACKed records"
                );
                metrics::gauge!("dispatcher_topic_buffer_full", "topic" => self.topic.clone(), "group" => group_label(group)).set(1.0);
            }
            *governing = slowest;
        }
    }

    fn mark_flowing(&self) {
        if self.records.available_permits() == 0 {
            return;
        }
        let mut governing = self.governing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = governing.take() {
            metrics::gauge!("dispatcher_topic_buffer_full", "topic" => self.topic.clone(), "group" => group_label(&old)).set(0.0);
        }
    }
}

/// Takes up to `wanted` permits without waiting; returns how many were taken. Counts only
/// what was really acquired: another group may take permits between looking and taking, and
/// charging for permits not held would let released charges grow the budget.
fn take_up_to(semaphore: &Semaphore, wanted: u32) -> u32 {
    loop {
        let available = (semaphore.available_permits() as u32).min(wanted);
        if available == 0 {
            return 0;
        }
        if let Ok(permits) = semaphore.try_acquire_many(available) {
            permits.forget();
            return available;
        }
        // Someone took permits meanwhile: look again.
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_spent_budget_blocks_and_names_the_biggest_holder() {
        let budget = TopicBudget::new("t", 10, 1_000);
        let slow = budget.reserve("slow", 8, 100).await;
        assert_eq!(slow.records, 8);
        let fast = budget.reserve("fast", 8, 100).await;
        assert_eq!(fast.records, 2, "only what is left");
        let waiting = {
            let budget = Arc::clone(&budget);
            tokio::spawn(async move { budget.reserve("fast", 4, 10).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        assert_eq!(budget.governing_group().as_deref(), Some("slow"));
        budget.release("fast", fast);
        let got = waiting.await.unwrap();
        assert_eq!(got.records, 2);
        assert_eq!(budget.held_by("slow"), slow);
        assert_eq!(kib_cost(0), 1);
        assert_eq!(kib_cost(1025), 2);
    }

    /// Groups reserving and releasing at once on several threads never hold more than the
    /// budget, and every permit comes back: a reservation charges only what it acquired.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_reservations_never_exceed_or_grow_the_budget() {
        const RECORDS: u32 = 40;
        const KIB: u32 = 64;
        let budget = TopicBudget::new("t", RECORDS, KIB);
        let tasks: Vec<_> = (0..8)
            .map(|n| {
                let budget = Arc::clone(&budget);
                tokio::spawn(async move {
                    let group = format!("g{n}");
                    for _ in 0..10_000 {
                        let charge = budget.reserve(&group, 10, 16).await;
                        assert!(charge.records >= 1 && charge.records <= 10, "{charge:?}");
                        assert!(charge.kib >= 1 && charge.kib <= 16, "{charge:?}");
                        tokio::task::yield_now().await;
                        budget.release(&group, charge);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(budget.records.available_permits(), RECORDS as usize);
        assert_eq!(budget.kib.available_permits(), KIB as usize);
    }

    /// One group that never returns what it holds cannot take the others' shares.
    #[tokio::test]
    async fn a_stuck_group_holds_only_its_share() {
        let budget = TopicBudget::new("t", 100, 1_000);
        budget.join("stuck");
        budget.join("flowing");
        assert_eq!(budget.share().records, 50);
        let mut stuck = Charge::default();
        for _ in 0..10 {
            let got =
                tokio::time::timeout(Duration::from_millis(50), budget.reserve("stuck", 30, 100))
                    .await;
            match got {
                Ok(charge) => {
                    stuck += charge;
                }
                Err(_) => break, // its share is spent: it waits
            }
        }
        assert_eq!(stuck.records, 50, "the stuck group stops at its share");
        // The other group still gets its whole share, at once.
        let flowing = tokio::time::timeout(
            Duration::from_millis(50),
            budget.reserve("flowing", 50, 100),
        )
        .await
        .unwrap();
        assert_eq!(flowing.records, 50);
        budget.release("flowing", flowing);
        // When the stuck group ends, the share of the one left grows.
        budget.release("stuck", stuck);
        budget.leave("stuck");
        assert_eq!(budget.share().records, 100);
        let all = budget.reserve("flowing", 100, 100).await;
        assert_eq!(all.records, 100);
    }

    #[test]
    fn take_up_to_counts_what_it_took() {
        let semaphore = Semaphore::new(5);
        assert_eq!(take_up_to(&semaphore, 3), 3);
        assert_eq!(take_up_to(&semaphore, 10), 2);
        assert_eq!(take_up_to(&semaphore, 10), 0);
        assert_eq!(semaphore.available_permits(), 0);
    }
}
