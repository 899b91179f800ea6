//! Several instances coordinated through etcd (DESIGN §8): membership with measured load, one
//! home instance per subscription group, and Recommend. Without `[cluster] etcd_endpoints`
//! none of this exists and the instance behaves as a single node.
//!
//! The contract ([`keys`] has the key layout):
//! * **Membership.** An instance holds one lease (`lease_ttl_secs`), renews it every
//!   `keepalive_secs` and rewrites its record ([`load`]) and its per-client session counts
//!   under it each time. A live instance with the same id (its record changes while we look)
//!   makes registration fail; a record that does not change for two keep-alive intervals
//!   belongs to a dead predecessor (a restart after `kill -9`) whose lease is revoked.
//! * **Homes.** A group is served only by the instance holding its home key, created if absent
//!   under the holder's lease before the group is created, and deleted (guarded by value and
//!   lease) after the group ends. Claims and releases of one instance are serialized with
//!   group creation, so a release never deletes the key of a group created meanwhile.
//! * **Fencing.** An instance whose lease was not renewed for `TTL − keepalive` stops serving:
//!   [`Cluster::may_serve`] turns false at once (groups check it before every delivery, so a
//!   process thawed after SIGSTOP delivers nothing more), then every group ends with
//!   UNAVAILABLE and its in-flight events come back from the next home. Its lease is then
//!   revoked (if it still exists) and the instance registers afresh. An etcd outage shorter
//!   than that limit never stops delivery; meanwhile no home can be claimed.
//! * **Recommend** answers from watch-fed copies ([`view`]), never waiting for etcd.

pub mod keys;
pub mod load;
pub mod meter;
pub mod mirror;
pub mod view;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, TxnOpResponse,
};
use eventmesh_common::shutdown::CancellationToken;
use tokio::sync::watch;

use crate::batching::Backoff;
use crate::config::ClusterSettings;
use crate::registry::{GroupKey, Shared};
use keys::Keys;
use load::{Asker, Candidate, InstanceRecord};
use meter::Meter;
use view::{Change, PrefixView};

/// How often the keep-alive loop looks at the fencing deadline.
const FENCE_CHECK: Duration = Duration::from_millis(100);

/// What can go wrong talking to the cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd answered with an error or could not be reached.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd did not answer in time.
    #[error("etcd did not answer {0} in time")]
    Timeout(&'static str),
    /// Another live process registered this instance id.
    #[error(
        "instance id {id:?} is registered by another live instance ({holder}); give this one another id"
    )]
    DuplicateInstance {
        /// The id.
        id: String,
        /// The holder's record.
        holder: String,
    },
    /// The instance is not registered (etcd unreachable since start, or fenced).
    #[error("this instance is not registered in etcd ({0}); try again or another instance")]
    NotRegistered(&'static str),
    /// The group's home is another live instance.
    #[error("subscription group {group} is homed at instance {instance} ({address})")]
    HomeElsewhere {
        /// The group.
        group: String,
        /// The home's id.
        instance: String,
        /// The home's client-facing address.
        address: String,
    },
}

/// What the cluster looks like from one instance (`emctl cluster`).
#[derive(Debug, Clone)]
pub struct Description {
    /// Live instances by id.
    pub instances: Vec<(String, InstanceRecord)>,
    /// Each homed group's `topic/group` path ([`keys::group_path`]) and home value.
    pub homes: Vec<(String, String)>,
}

/// An instance's membership in the cluster.
pub struct Cluster {
    settings: ClusterSettings,
    keys: Keys,
    instance_id: String,
    address: String,
    client: Client,
    call_timeout: Duration,
    /// The lease while registered and not fenced.
    lease: watch::Sender<Option<i64>>,
    /// When the lease was last renewed, ms since `started` (0: never).
    renewed_at_ms: AtomicU64,
    started: Instant,
    meter: Arc<Meter>,
    instances: PrefixView,
    clients: PrefixView,
    homes: PrefixView,
    mirror: mirror::Mirror,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("instance_id", &self.instance_id)
            .field("lease", &*self.lease.borrow())
            .finish_non_exhaustive()
    }
}

/// Unix time in milliseconds.
pub fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn bounded<T>(
    limit: Duration,
    what: &'static str,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ClusterError> {
    tokio::time::timeout(limit, call)
        .await
        .map_err(|_| ClusterError::Timeout(what))?
        .map_err(ClusterError::from)
}

impl Cluster {
    /// A client of the configured etcd (connections are made lazily: etcd may come later).
    pub async fn connect(
        settings: &ClusterSettings,
        instance_id: String,
        address: String,
        meter: Arc<Meter>,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let client = Client::connect(&settings.etcd_endpoints, Some(options)).await?;
        let keys = Keys::new(&settings.etcd_prefix);
        // A call never outlives a keep-alive interval: a late answer could not keep the lease.
        let call_timeout = settings.keepalive().min(Duration::from_secs(3));
        Ok(Arc::new(Cluster {
            instances: PrefixView::new(keys.instances()),
            clients: PrefixView::new(keys.clients()),
            homes: PrefixView::new(keys.homes()),
            mirror: mirror::Mirror::new(keys.clone(), settings.mirror_progress),
            settings: settings.clone(),
            keys,
            instance_id,
            address,
            client,
            call_timeout,
            lease: watch::Sender::new(None),
            renewed_at_ms: AtomicU64::new(0),
            started: Instant::now(),
            meter,
        }))
    }

    /// This instance's id.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The etcd client.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The deadline of one etcd call.
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// The progress mirror.
    pub fn mirror(&self) -> &mirror::Mirror {
        &self.mirror
    }

    /// The lease while registered and not fenced.
    pub fn lease(&self) -> Option<i64> {
        *self.lease.borrow()
    }

    /// Changes of [`Cluster::lease`].
    pub fn lease_changes(&self) -> watch::Receiver<Option<i64>> {
        self.lease.subscribe()
    }

    /// Whether this instance may deliver to its groups now: registered, and its lease renewed
    /// within the fencing limit (so no other instance can have taken its groups over).
    pub fn may_serve(&self) -> bool {
        if self.lease().is_none() {
            return false;
        }
        let renewed = self.renewed_at_ms.load(Ordering::Acquire);
        let now = self.started.elapsed().as_millis() as u64;
        renewed > 0 && now.saturating_sub(renewed) < self.fence_after().as_millis() as u64
    }

    fn fence_after(&self) -> Duration {
        self.settings
            .lease_ttl()
            .saturating_sub(self.settings.keepalive())
    }

    fn mark_renewed(&self) {
        let now = (self.started.elapsed().as_millis() as u64).max(1);
        self.renewed_at_ms.store(now, Ordering::Release);
    }

    fn home_value(&self) -> String {
        format!("{}|{}", self.instance_id, self.address)
    }

    /// Registers the instance: a fresh lease, then its record created if absent (see the
    /// module docs for a record that is already there). Returns the lease.
    pub async fn register(&self) -> Result<i64, ClusterError> {
        let mut client = self.client.clone();
        let ttl = self.settings.lease_ttl_secs as i64;
        let lease = bounded(
            self.call_timeout,
            "a lease grant",
            client.lease_grant(ttl, None),
        )
        .await?
        .id();
        match self.create_record(lease).await {
            Ok(()) => {
                self.mark_renewed();
                self.lease.send_replace(Some(lease));
                tracing::info!(instance = %self.instance_id, lease, "registered in etcd");
                Ok(lease)
            }
            Err(error) => {
                let _ = bounded(
                    self.call_timeout,
                    "a lease revoke",
                    client.lease_revoke(lease),
                )
                .await;
                Err(error)
            }
        }
    }

    async fn create_record(&self, lease: i64) -> Result<(), ClusterError> {
        let mut client = self.client.clone();
        let key = self.keys.instance(&self.instance_id);
        // A live holder rewrites its record every keep-alive: watching it for two intervals
        // tells a live one from a dead predecessor.
        let patience = self.settings.keepalive() * 2 + Duration::from_secs(1);
        let started = Instant::now();
        let mut first_seen: Option<i64> = None;
        loop {
            let txn = Txn::new()
                .when([Compare::version(key.as_str(), CompareOp::Equal, 0)])
                .and_then(self.record_ops(lease))
                .or_else([TxnOp::get(key.as_str(), None)]);
            let answer = bounded(self.call_timeout, "a registration", client.txn(txn)).await?;
            if answer.succeeded() {
                return Ok(());
            }
            let Some(holder) = first_kv(&answer.op_responses()) else {
                continue; // gone meanwhile: try again at once
            };
            let holder_value = String::from_utf8_lossy(holder.value()).into_owned();
            match first_seen {
                None => first_seen = Some(holder.mod_revision()),
                Some(revision) if revision != holder.mod_revision() => {
                    return Err(ClusterError::DuplicateInstance {
                        id: self.instance_id.clone(),
                        holder: holder_value,
                    });
                }
                Some(_) => {}
            }
            if started.elapsed() >= patience {
                tracing::warn!(instance = %self.instance_id, holder = %holder_value, "this instance id is held by a process that stopped renewing it (a predecessor that died); taking it over");
                if holder.lease() != 0 {
                    let _ = bounded(
                        self.call_timeout,
                        "a lease revoke",
                        client.lease_revoke(holder.lease()),
                    )
                    .await;
                }
                let guarded = Txn::new()
                    .when([Compare::mod_revision(
                        key.as_str(),
                        CompareOp::Equal,
                        holder.mod_revision(),
                    )])
                    .and_then([TxnOp::delete(key.as_str(), None)]);
                let _ = bounded(self.call_timeout, "a delete", client.txn(guarded)).await?;
                first_seen = None;
                continue;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The writes of the instance's record and client counts under `lease`.
    fn record_ops(&self, lease: i64) -> Vec<TxnOp> {
        let record = InstanceRecord {
            ts_millis: now_millis(),
            address: self.address.clone(),
            load: Some(self.meter.sample()),
        };
        let with_lease = || Some(PutOptions::new().with_lease(lease));
        vec![
            TxnOp::put(
                self.keys.instance(&self.instance_id),
                record.encode(),
                with_lease(),
            ),
            TxnOp::put(
                self.keys.client_counts(&self.instance_id),
                load::encode_client_counts(&self.meter.sessions_by_client()),
                with_lease(),
            ),
        ]
    }

    /// Starts the tasks that keep the instance registered and its views current. `shared`
    /// is held weakly: the tasks end with the instance.
    pub fn spawn(self: &Arc<Self>, shared: &Arc<Shared>, shutdown: CancellationToken) {
        let weak = Arc::downgrade(shared);
        tokio::spawn(Arc::clone(self).membership(weak.clone(), shutdown.clone()));
        for view in [&self.instances, &self.clients] {
            tokio::spawn(view.clone().follow(
                self.client(),
                self.call_timeout,
                shutdown.clone(),
                |_| {},
            ));
        }
        let cluster = Arc::downgrade(self);
        let on_home_change = move |changes: &[Change]| {
            if let (Some(cluster), Some(shared)) = (cluster.upgrade(), weak.upgrade()) {
                cluster.homes_changed(&shared, changes);
            }
        };
        tokio::spawn(self.homes.clone().follow(
            self.client(),
            self.call_timeout,
            shutdown.clone(),
            on_home_change,
        ));
        tokio::spawn(mirror::run(
            Arc::clone(self),
            Arc::downgrade(shared),
            shutdown,
        ));
    }

    /// Registration, keep-alive and fencing, until shutdown.
    async fn membership(self: Arc<Self>, shared: Weak<Shared>, shutdown: CancellationToken) {
        let mut backoff = Backoff::default();
        // A lease given up while etcd was unreachable: revoked before registering again, so
        // the homes it held (and our own record) go at once instead of after its TTL — etcd
        // extends every lease when it restarts.
        let mut abandoned: Option<i64> = None;
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            if let Some(old) = abandoned {
                let mut client = self.client.clone();
                match bounded(
                    self.call_timeout,
                    "a lease revoke",
                    client.lease_revoke(old),
                )
                .await
                {
                    // Revoked, or already gone (etcd answers NOT_FOUND for an expired lease).
                    Ok(_) => abandoned = None,
                    Err(ClusterError::Etcd(etcd_client::Error::GRpcStatus(status)))
                        if status.code() == tonic::Code::NotFound =>
                    {
                        abandoned = None;
                    }
                    Err(error) => {
                        tracing::debug!(%error, "revoking the abandoned lease failed; retrying");
                        tokio::select! {
                            () = tokio::time::sleep(backoff.next_delay()) => continue,
                            () = shutdown.cancelled() => return,
                        }
                    }
                }
            }
            let lease = match self.lease() {
                Some(lease) => lease,
                None => match self.register().await {
                    Ok(lease) => lease,
                    Err(error) => {
                        tracing::warn!(%error, "registering in etcd failed; retrying");
                        tokio::select! {
                            () = tokio::time::sleep(backoff.next_delay()) => continue,
                            () = shutdown.cancelled() => return,
                        }
                    }
                },
            };
            backoff.reset();
            let why = self.keep_alive(lease, &shutdown).await;
            if shutdown.is_cancelled() {
                return;
            }
            // Fenced: stop serving first, then end the groups, then start afresh.
            self.lease.send_replace(None);
            tracing::error!(instance = %self.instance_id, lease, why, "home lease lost: this instance gives up its groups and registers again");
            metrics::counter!("dispatcher_cluster_fenced_total").increment(1);
            if let Some(shared) = shared.upgrade() {
                shared.end_all(tonic::Status::unavailable(format!(
                    "home lease lost ({why}); reconnect (Recommend names the group's new home)"
                )));
            }
            abandoned = Some(lease);
        }
    }

    /// Renews `lease` every keep-alive and rewrites the record; returns why it stopped (lease
    /// expired, or not renewed within the fencing limit) — or at shutdown.
    async fn keep_alive(&self, lease: i64, shutdown: &CancellationToken) -> &'static str {
        let mut keeper: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
        let mut next_renewal = Instant::now() + self.settings.keepalive();
        let mut last_renewed = Instant::now();
        loop {
            tokio::select! {
                () = tokio::time::sleep(FENCE_CHECK) => {}
                () = shutdown.cancelled() => return "shutdown",
            }
            if Instant::now() >= next_renewal {
                next_renewal = Instant::now() + self.settings.keepalive();
                match self.renew(&mut keeper, lease).await {
                    Ok(ttl) if ttl > 0 => {
                        last_renewed = Instant::now();
                        self.mark_renewed();
                        let mut client = self.client.clone();
                        let rewrite = Txn::new().and_then(self.record_ops(lease));
                        if let Err(error) =
                            bounded(self.call_timeout, "a record rewrite", client.txn(rewrite))
                                .await
                        {
                            tracing::debug!(%error, "rewriting the instance record failed");
                        }
                    }
                    Ok(_) => return "the lease expired",
                    Err(error) => {
                        keeper = None;
                        tracing::warn!(%error, since = ?last_renewed.elapsed(), "renewing the lease failed");
                    }
                }
            }
            if last_renewed.elapsed() >= self.fence_after() {
                return "not renewed within the fencing limit";
            }
        }
    }

    async fn renew(
        &self,
        keeper: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
        lease: i64,
    ) -> Result<i64, ClusterError> {
        if keeper.is_none() {
            let mut client = self.client.clone();
            *keeper = Some(
                bounded(
                    self.call_timeout,
                    "a keep-alive stream",
                    client.lease_keep_alive(lease),
                )
                .await?,
            );
        }
        let Some((sender, answers)) = keeper.as_mut() else {
            return Err(ClusterError::NotRegistered("no keep-alive stream"));
        };
        bounded(self.call_timeout, "a keep-alive", sender.keep_alive()).await?;
        match bounded(self.call_timeout, "a keep-alive", answers.message()).await? {
            Some(answer) => Ok(answer.ttl()),
            None => Err(ClusterError::NotRegistered("the keep-alive stream ended")),
        }
    }

    /// Revokes the lease (graceful shutdown): the record and every home of this instance go at
    /// once, so clients find the groups' next homes without waiting for the TTL.
    pub async fn leave(&self) {
        let Some(lease) = self.lease.send_replace(None) else {
            return;
        };
        let mut client = self.client.clone();
        match bounded(
            self.call_timeout,
            "a lease revoke",
            client.lease_revoke(lease),
        )
        .await
        {
            Ok(_) => tracing::info!(instance = %self.instance_id, "left the cluster"),
            Err(error) => {
                tracing::warn!(%error, "revoking the lease failed; its keys go with its TTL")
            }
        }
    }

    /// Claims `key`'s home for this instance (create if absent under the lease). Call with
    /// group creation held.
    pub async fn claim_home(&self, key: &GroupKey) -> Result<(), ClusterError> {
        let lease = self
            .lease()
            .ok_or(ClusterError::NotRegistered("no home can be claimed"))?;
        if !self.may_serve() {
            return Err(ClusterError::NotRegistered(
                "the lease is not being renewed",
            ));
        }
        let home = self.keys.home(&key.topic, key.group.as_ref());
        let ours = self.home_value();
        let put = || {
            TxnOp::put(
                home.as_str(),
                ours.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            )
        };
        let mut client = self.client.clone();
        let txn = Txn::new()
            .when([Compare::version(home.as_str(), CompareOp::Equal, 0)])
            .and_then([put()])
            .or_else([TxnOp::get(home.as_str(), None)]);
        let answer = bounded(self.call_timeout, "a home claim", client.txn(txn)).await?;
        if answer.succeeded() {
            metrics::counter!("dispatcher_cluster_home_claims_total").increment(1);
            return Ok(());
        }
        let Some(holder) = first_kv(&answer.op_responses()) else {
            return Err(ClusterError::NotRegistered(
                "the home key changed while claiming",
            ));
        };
        let value = String::from_utf8_lossy(holder.value()).into_owned();
        let (instance, address) = value.split_once('|').unwrap_or((value.as_str(), ""));
        if instance == self.instance_id {
            // Ours, perhaps under a lease given up since: take it under the current one.
            let retake = Txn::new()
                .when([Compare::mod_revision(
                    home.as_str(),
                    CompareOp::Equal,
                    holder.mod_revision(),
                )])
                .and_then([put()]);
            let answer = bounded(self.call_timeout, "a home claim", client.txn(retake)).await?;
            return if answer.succeeded() {
                Ok(())
            } else {
                Err(ClusterError::NotRegistered(
                    "the home key changed while claiming",
                ))
            };
        }
        Err(ClusterError::HomeElsewhere {
            group: key.to_string(),
            instance: instance.to_owned(),
            address: address.to_owned(),
        })
    }

    /// Deletes `key`'s home if this instance holds it under its lease. Call with group
    /// creation held and no live group of `key`.
    pub async fn release_home(&self, key: &GroupKey) {
        let Some(lease) = self.lease() else { return };
        let home = self.keys.home(&key.topic, key.group.as_ref());
        let txn = Txn::new()
            .when([
                Compare::value(home.as_str(), CompareOp::Equal, self.home_value()),
                Compare::lease(home.as_str(), CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::delete(home.as_str(), Some(DeleteOptions::new()))]);
        let mut client = self.client.clone();
        match bounded(self.call_timeout, "a home release", client.txn(txn)).await {
            Ok(answer) if answer.succeeded() => {
                tracing::debug!(group = %key, "home released");
            }
            Ok(_) => {}
            // Left to the lease: the key names this instance, which answers a later Open for
            // the group itself.
            Err(error) => tracing::warn!(group = %key, %error, "releasing the group's home failed"),
        }
    }

    /// Home keys changed: a live group here whose key now names another instance (or is gone,
    /// which only the lease's end does while the group lives) is given up.
    fn homes_changed(&self, shared: &Arc<Shared>, changes: &[Change]) {
        let ours = self.home_value();
        let lost: Vec<&str> = changes
            .iter()
            .filter(|(_, entry)| entry.as_ref().is_none_or(|e| e.value != ours))
            .map(|(key, _)| key.as_str())
            .collect();
        if lost.is_empty() {
            return;
        }
        for key in shared.group_keys() {
            let home = self.keys.home(&key.topic, key.group.as_ref());
            if lost.contains(&home.as_str()) {
                tracing::warn!(group = %key, "the group's home key no longer names this instance; giving the group up");
                shared.end_group(
                    &key,
                    tonic::Status::unavailable(format!(
                        "subscription group {key} moved to another instance; reconnect"
                    )),
                );
            }
        }
    }

    /// The instance to recommend to `asker`, from the current views: the group's live home
    /// unless excluded, else the best-scored live instance (module [`load`]). `None`: nothing
    /// known yet (the caller answers with itself).
    pub fn recommend(
        &self,
        asker: Asker<'_>,
        group: Option<&GroupKey>,
        exclude: &[String],
    ) -> Option<(String, String)> {
        let now = now_millis();
        let ttl = self.settings.lease_ttl().as_millis() as u64;
        let instances: HashMap<String, InstanceRecord> = self
            .instances
            .snapshot()
            .into_iter()
            .filter_map(|(key, entry)| {
                let id = self.keys.instance_id_of(&key)?;
                Some((id, InstanceRecord::parse_live(&entry.value, now, ttl)?))
            })
            .collect();
        if let Some(group) = group {
            let home = self.keys.home(&group.topic, group.group.as_ref());
            if let Some(entry) = self.homes.get(&home)
                && let Some((id, address)) = entry.value.split_once('|')
                && !exclude.iter().any(|e| e == id)
                && instances.contains_key(id)
            {
                return Some((id.to_owned(), address.to_owned()));
            }
        }
        let counts: HashMap<String, HashMap<String, u64>> = self
            .clients
            .snapshot()
            .into_iter()
            .filter_map(|(key, entry)| {
                Some((
                    self.keys.client_counts_owner(&key)?,
                    load::parse_client_counts(&entry.value),
                ))
            })
            .collect();
        let candidates: Vec<Candidate> = instances
            .into_iter()
            .map(|(id, record)| Candidate {
                client_sessions: counts
                    .get(&id)
                    .and_then(|c| c.get(asker.client))
                    .copied()
                    .unwrap_or(0),
                id,
                record,
            })
            .collect();
        load::choose(&candidates, exclude, asker)
            .map(|chosen| (chosen.id.clone(), chosen.record.address.clone()))
    }

    /// Live instances and group homes, for `emctl cluster`.
    pub fn describe(&self) -> Description {
        let now = now_millis();
        let ttl = self.settings.lease_ttl().as_millis() as u64;
        let instances = self
            .instances
            .snapshot()
            .into_iter()
            .filter_map(|(key, entry)| {
                Some((
                    self.keys.instance_id_of(&key)?,
                    InstanceRecord::parse_live(&entry.value, now, ttl)?,
                ))
            })
            .collect();
        let homes = self
            .homes
            .snapshot()
            .into_iter()
            .filter_map(|(key, entry)| {
                Some((self.keys.home_path_of(&key)?.to_owned(), entry.value))
            })
            .collect();
        Description { instances, homes }
    }

    /// Waits until the views reflect etcd at least once (tests, and a start that wants a
    /// first view before answering Recommend).
    pub async fn views_loaded(&self, wait: Duration) -> bool {
        let loaded = async {
            for view in [&self.instances, &self.clients, &self.homes] {
                let mut updates = view.updates();
                let _ = updates.wait_for(|v| *v > 0).await;
            }
        };
        tokio::time::timeout(wait, loaded).await.is_ok()
    }
}

fn first_kv(responses: &[TxnOpResponse]) -> Option<etcd_client::KeyValue> {
    responses.iter().find_map(|response| match response {
        TxnOpResponse::Get(get) => get.kvs().first().cloned(),
        _ => None,
    })
}
