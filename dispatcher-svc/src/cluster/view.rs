//! A local copy of every key under one etcd prefix, kept current by a watch: read the prefix,
//! then watch it from the next revision; whenever the watch breaks (etcd restarted, compacted,
//! unreachable), read again. Readers never wait for etcd: while it is unreachable they see the
//! last state (Recommend answers from it).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use eventmesh_common::shutdown::CancellationToken;
use tokio::sync::watch;

use crate::batching::Backoff;

/// One key's value and the lease it is attached to (0: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The value, as UTF-8 (values this cluster writes always are; others are skipped).
    pub value: String,
    /// The key's lease.
    pub lease: i64,
}

/// A change under the prefix: the key and its new entry (`None`: deleted).
pub type Change = (String, Option<Entry>);

/// The copy of one prefix.
#[derive(Debug, Clone)]
pub struct PrefixView {
    prefix: String,
    entries: Arc<Mutex<BTreeMap<String, Entry>>>,
    /// Counts applied updates (a full read counts one); tests and callers wait on it.
    version: watch::Sender<u64>,
}

impl PrefixView {
    /// An empty copy of `prefix`; [`PrefixView::follow`] fills it.
    pub fn new(prefix: String) -> Self {
        PrefixView {
            prefix,
            entries: Arc::default(),
            version: watch::Sender::new(0),
        }
    }

    /// Every entry now.
    pub fn snapshot(&self) -> BTreeMap<String, Entry> {
        self.lock().clone()
    }

    /// One key's entry now.
    pub fn get(&self, key: &str) -> Option<Entry> {
        self.lock().get(key).cloned()
    }

    /// Waits until an update after the current one has been applied.
    pub fn updates(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps the copy current until `shutdown`; `on_change` sees every change after it is
    /// applied (a full read reports what differs from the copy before it).
    pub async fn follow(
        self,
        mut client: Client,
        call_timeout: Duration,
        shutdown: CancellationToken,
        on_change: impl Fn(&[Change]) + Send + 'static,
    ) {
        let mut backoff = Backoff::default();
        loop {
            let round = self.follow_once(&mut client, call_timeout, &on_change);
            let outcome = tokio::select! {
                outcome = round => outcome,
                () = shutdown.cancelled() => return,
            };
            if let Err(error) = outcome {
                tracing::debug!(prefix = %self.prefix, %error, "etcd watch broke; reading again");
            } else {
                backoff = Backoff::default();
            }
            tokio::select! {
                () = tokio::time::sleep(backoff.next_delay()) => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// One read and the watch after it; returns when the watch ends.
    async fn follow_once(
        &self,
        client: &mut Client,
        call_timeout: Duration,
        on_change: &impl Fn(&[Change]),
    ) -> Result<(), etcd_client::Error> {
        let read = tokio::time::timeout(
            call_timeout,
            client.get(self.prefix.as_str(), Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| etcd_client::Error::WatchError("reading the prefix timed out".into()))??;
        let revision = read.header().map_or(0, |h| h.revision());
        let fresh: BTreeMap<String, Entry> = read
            .kvs()
            .iter()
            .filter_map(|kv| {
                Some((
                    kv.key_str().ok()?.to_owned(),
                    Entry {
                        value: kv.value_str().ok()?.to_owned(),
                        lease: kv.lease(),
                    },
                ))
            })
            .collect();
        let changes = {
            let mut entries = self.lock();
            let mut changes: Vec<Change> = entries
                .keys()
                .filter(|key| !fresh.contains_key(*key))
                .map(|key| (key.clone(), None))
                .collect();
            changes.extend(
                fresh
                    .iter()
                    .filter(|(key, entry)| entries.get(*key) != Some(entry))
                    .map(|(key, entry)| (key.clone(), Some(entry.clone()))),
            );
            *entries = fresh;
            changes
        };
        self.version.send_modify(|v| *v += 1);
        on_change(&changes);
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = tokio::time::timeout(
            call_timeout,
            client.watch(self.prefix.as_str(), Some(options)),
        )
        .await
        .map_err(|_| etcd_client::Error::WatchError("starting the watch timed out".into()))??;
        while let Some(response) = stream.message().await? {
            if response.canceled() {
                return Err(etcd_client::Error::WatchError(format!(
                    "watch canceled: {}",
                    response.cancel_reason()
                )));
            }
            let mut changes = Vec::with_capacity(response.events().len());
            {
                let mut entries = self.lock();
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    let Ok(key) = kv.key_str() else { continue };
                    match event.event_type() {
                        EventType::Put => {
                            let Ok(value) = kv.value_str() else { continue };
                            let entry = Entry {
                                value: value.to_owned(),
                                lease: kv.lease(),
                            };
                            entries.insert(key.to_owned(), entry.clone());
                            changes.push((key.to_owned(), Some(entry)));
                        }
                        EventType::Delete => {
                            entries.remove(key);
                            changes.push((key.to_owned(), None));
                        }
                    }
                }
            }
            self.version.send_modify(|v| *v += 1);
            on_change(&changes);
        }
        Ok(())
    }
}
