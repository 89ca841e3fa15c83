//! The agent's Events on its Node, aggregated and rate-limited per node the way the kubelet's
//! own are (client-go's `tools/record` event correlator), so that a fleet whose nodes all fail
//! the same way (a bad driver rollout on thousands of nodes) does not bury the API server in
//! Event objects.
//!
//! - **One object per reason and window.** An Event object stands for its type and reason for
//!   [`Policy::window`] after it was created (10 minutes, client-go's aggregation interval).
//!   Repeats in that time raise its `count` and replace its `message` and `lastTimestamp`, with
//!   a merge patch (client-go's count bump); a repeat after it is a new object.
//! - **Writes per node come from a token bucket**, as client-go's spam filter per source and
//!   object: a burst of [`Policy::burst`] (25), then one more every [`Policy::refill`] (5
//!   minutes). And one object is patched at most once per [`Policy::patch_interval`] (a
//!   minute), after a burst of [`Policy::patch_burst`] (3) so that a quick run of news (MIG
//!   pending: changing the GPUs, then waiting for GPU work to end) shows at once.
//! - **Nothing is dropped for the rate.** Where client-go's spam filter drops what is over the
//!   rate, an occurrence that may not be written now waits in its key's pending count and goes
//!   out with the next write allowed for that key, so the counts on the server add up to the
//!   occurrences exactly. New reasons go before count bumps when writes are scarce, so the
//!   first Event of a reason is posted at once whenever the bucket has a token.
//!
//! [`Aggregator`] decides what to write and when, without I/O (time is an argument, so tests
//! need no sleeping); [`run`] is the task that sends it, sleeping until the next write is due
//! and not at all while nothing waits.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, watch};

use crate::host::backoff::Backoff;
use crate::kube::{EventType, KubeClient, KubeError, MAX_EVENT_MESSAGE, NodeEvent, NodeView};
use crate::names::truncate;

/// The limits of [`Aggregator`]; [`Default`] is the kubelet's (client-go's) habit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// How long after its creation an Event object takes the repeats of its type and reason;
    /// a repeat after that is a new object.
    pub window: Duration,
    /// How many writes (creates and patches) a node may make at once: the token bucket's size.
    pub burst: u32,
    /// One more write is allowed per this long, up to `burst`.
    pub refill: Duration,
    /// One Event object may be patched once per this long, after a burst of `patch_burst`:
    /// its own token bucket, full when the object is created.
    pub patch_interval: Duration,
    /// How many patches of one object may go at once.
    pub patch_burst: u32,
    /// How many (type, reason) keys are remembered; beyond that the one idle longest is
    /// forgotten.
    pub max_keys: usize,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            window: Duration::from_secs(10 * 60),
            burst: 25,
            refill: Duration::from_secs(5 * 60),
            patch_interval: Duration::from_secs(60),
            patch_burst: 3,
            max_keys: 64,
        }
    }
}

impl Policy {
    /// This policy with every duration divided by `scale` (the fleet bench's simulated time;
    /// 1 in production).
    pub fn scaled(self, scale: f64) -> Policy {
        Policy {
            window: self.window.div_f64(scale),
            refill: self.refill.div_f64(scale),
            patch_interval: self.patch_interval.div_f64(scale),
            ..self
        }
    }
}

/// What one write sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A new Event object (POST), standing for `count` occurrences.
    Create,
    /// The object of this name, whose `count` becomes the write's `count` (PATCH).
    Patch { name: String },
}

/// A write the aggregator allows now. Hand it back with the outcome: [`Aggregator::created`],
/// [`Aggregator::patched`], [`Aggregator::gone`], [`Aggregator::failed`] or
/// [`Aggregator::rejected`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    pub event_type: EventType,
    pub reason: String,
    /// The latest message of the reason.
    pub message: String,
    pub target: Target,
    /// The `count` the object carries after the write: the occurrences a create stands for,
    /// or a patched object's new total.
    pub count: u64,
    /// The occurrences this write adds to what the server has.
    pub adds: u64,
    /// When the first of them happened.
    pub first: Instant,
    /// When the last of them happened (the Event's `lastTimestamp`).
    pub last: Instant,
}

/// A key forgotten to keep within [`Policy::max_keys`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forgotten {
    pub event_type: EventType,
    pub reason: String,
    /// Occurrences it still had to write, lost with it (0 for an idle key).
    pub pending: u64,
}

/// The Event object last created for a key.
#[derive(Debug, Clone)]
struct Object {
    name: String,
    created: Instant,
    /// Its `count` on the server.
    count: u64,
    /// Its patches' token bucket.
    patches: Bucket,
}

/// What is known of one (type, reason).
#[derive(Debug, Clone)]
struct Entry {
    event_type: EventType,
    reason: String,
    message: String,
    /// Occurrences not written yet.
    pending: u64,
    /// When the oldest of them happened (meaningful while `pending > 0`).
    pending_since: Instant,
    /// The latest occurrence.
    last_seen: Instant,
    object: Option<Object>,
}

/// A token bucket: `tokens` left, one more per refill interval counted from `since`, up to
/// its burst. Its sizes come from [`Policy`].
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: u32,
    /// Refills are counted from here (set when a full bucket loses a token).
    since: Instant,
}

impl Bucket {
    fn full(burst: u32, now: Instant) -> Bucket {
        Bucket {
            tokens: burst,
            since: now,
        }
    }

    /// The bucket as it is at `now`, refills added.
    fn at(self, now: Instant, burst: u32, refill: Duration) -> Bucket {
        if self.tokens >= burst || refill.is_zero() {
            return Bucket::full(burst, now);
        }
        let gained = now.saturating_duration_since(self.since).as_nanos() / refill.as_nanos();
        let gained = u32::try_from(gained).unwrap_or(u32::MAX);
        match self.tokens.saturating_add(gained) {
            tokens if tokens >= burst => Bucket::full(burst, now),
            // Fewer than `burst` gained: the multiplication stays small.
            tokens => Bucket {
                tokens,
                since: self.since + refill * gained,
            },
        }
    }

    /// When it has a token: `now` if it has one now.
    fn next_at(self, now: Instant, burst: u32, refill: Duration) -> Instant {
        let bucket = self.at(now, burst, refill);
        if bucket.tokens > 0 { now } else { bucket.since + refill }
    }

    /// Takes a token at `now`, if there is one.
    fn take(&mut self, now: Instant, burst: u32, refill: Duration) -> bool {
        *self = self.at(now, burst, refill);
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

/// Decides, per node, which Event writes go out and when; see the module docs.
#[derive(Debug, Clone)]
pub struct Aggregator {
    policy: Policy,
    entries: Vec<Entry>,
    bucket: Bucket,
    /// No write before this (the server asked to wait, or the last write failed).
    hold: Option<Instant>,
}

impl Aggregator {
    /// An aggregator with a full bucket at `now`.
    pub fn new(policy: Policy, now: Instant) -> Aggregator {
        let bucket = Bucket::full(policy.burst, now);
        Aggregator {
            policy,
            entries: Vec::new(),
            bucket,
            hold: None,
        }
    }

    /// Notes one occurrence at `now`. Returns the key forgotten to make room for a new one,
    /// if any.
    pub fn record(&mut self, event_type: EventType, reason: &str, message: &str, now: Instant) -> Option<Forgotten> {
        let mut forgotten = None;
        let i = match self.index(event_type, reason) {
            Some(i) => i,
            None => {
                if self.entries.len() >= self.policy.max_keys.max(1) {
                    forgotten = self.forget_one();
                }
                self.entries.push(Entry {
                    event_type,
                    reason: reason.to_owned(),
                    message: String::new(),
                    pending: 0,
                    pending_since: now,
                    last_seen: now,
                    object: None,
                });
                self.entries.len() - 1
            }
        };
        let entry = &mut self.entries[i];
        if entry.pending == 0 {
            entry.pending_since = now;
        }
        entry.pending = entry.pending.saturating_add(1);
        entry.last_seen = now;
        entry.message = truncate(message, MAX_EVENT_MESSAGE).to_owned();
        forgotten
    }

    /// The next write allowed at `now`, with its token taken; `None` when nothing may be
    /// written now. New objects go before count bumps, then the longest waiting first.
    pub fn next_write(&mut self, now: Instant) -> Option<Write> {
        if self.hold.is_some_and(|hold| hold > now) {
            return None;
        }
        let i = (0..self.entries.len())
            .filter(|&i| self.entries[i].pending > 0 && self.ready_at(&self.entries[i], now) <= now)
            .min_by_key(|&i| (!self.creates(&self.entries[i], now), self.entries[i].pending_since))?;
        let Policy {
            burst,
            refill,
            patch_burst,
            patch_interval,
            ..
        } = self.policy;
        if !self.bucket.take(now, burst, refill) {
            return None;
        }
        let create = self.creates(&self.entries[i], now);
        if let (false, Some(object)) = (create, self.entries[i].object.as_mut()) {
            // Ready, and not a create: the object's bucket has a token.
            object.patches.take(now, patch_burst, patch_interval);
        }
        let entry = &self.entries[i];
        let (target, count) = match (&entry.object, create) {
            (Some(object), false) => (
                Target::Patch {
                    name: object.name.clone(),
                },
                object.count.saturating_add(entry.pending),
            ),
            _ => (Target::Create, entry.pending),
        };
        Some(Write {
            event_type: entry.event_type,
            reason: entry.reason.clone(),
            message: entry.message.clone(),
            target,
            count,
            adds: entry.pending,
            first: entry.pending_since,
            last: entry.last_seen,
        })
    }

    /// The write's object was created, named `name` by the server, at `now`.
    pub fn created(&mut self, write: &Write, name: String, now: Instant) {
        let patch_burst = self.policy.patch_burst;
        if let Some(entry) = self.entry_mut(write) {
            entry.pending = entry.pending.saturating_sub(write.adds);
            entry.object = Some(Object {
                name,
                created: now,
                count: write.count,
                patches: Bucket::full(patch_burst, now),
            });
        }
    }

    /// The write's patch went through.
    pub fn patched(&mut self, write: &Write) {
        let Target::Patch { name } = &write.target else {
            return;
        };
        if let Some(entry) = self.entry_mut(write) {
            entry.pending = entry.pending.saturating_sub(write.adds);
            if let Some(object) = entry.object.as_mut().filter(|o| &o.name == name) {
                object.count = write.count;
            }
        }
    }

    /// The patched object is gone from the server (404: expired or deleted): the occurrences
    /// stay pending and go into a new object.
    pub fn gone(&mut self, write: &Write) {
        let Target::Patch { name } = &write.target else {
            return;
        };
        if let Some(entry) = self.entry_mut(write)
            && entry.object.as_ref().is_some_and(|o| &o.name == name)
        {
            entry.object = None;
        }
    }

    /// The write failed in a way worth trying again (429, 5xx, no connection): its occurrences
    /// stay pending and nothing is written before `until`.
    pub fn failed(&mut self, until: Instant) {
        self.hold = Some(until);
    }

    /// The server refused the write for good (403, 422, ...): its occurrences are dropped, and
    /// their number returned.
    pub fn rejected(&mut self, write: &Write) -> u64 {
        match self.entry_mut(write) {
            Some(entry) => {
                let dropped = write.adds.min(entry.pending);
                entry.pending -= dropped;
                dropped
            }
            None => 0,
        }
    }

    /// When the next write may go (at or before `now`: at once); `None` when nothing waits.
    pub fn next_due(&self, now: Instant) -> Option<Instant> {
        let ready = self
            .entries
            .iter()
            .filter(|e| e.pending > 0)
            .map(|e| self.ready_at(e, now))
            .min()?;
        let due = ready.max(self.bucket.next_at(now, self.policy.burst, self.policy.refill));
        Some(match self.hold {
            Some(hold) => due.max(hold),
            None => due,
        })
    }

    /// Occurrences not written yet, over all keys.
    pub fn pending(&self) -> u64 {
        self.entries.iter().map(|e| e.pending).sum()
    }

    /// How many (type, reason) keys are remembered.
    pub fn keys(&self) -> usize {
        self.entries.len()
    }

    fn index(&self, event_type: EventType, reason: &str) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| e.event_type == event_type && e.reason == reason)
    }

    fn entry_mut(&mut self, write: &Write) -> Option<&mut Entry> {
        let i = self.index(write.event_type, &write.reason)?;
        Some(&mut self.entries[i])
    }

    /// Removes the key idle longest (nothing pending), else the one seen longest ago.
    fn forget_one(&mut self) -> Option<Forgotten> {
        let oldest = |idle: bool| {
            (0..self.entries.len())
                .filter(|&i| !idle || self.entries[i].pending == 0)
                .min_by_key(|&i| self.entries[i].last_seen)
        };
        let i = oldest(true).or_else(|| oldest(false))?;
        let entry = self.entries.remove(i);
        Some(Forgotten {
            event_type: entry.event_type,
            reason: entry.reason,
            pending: entry.pending,
        })
    }

    /// Whether the entry's next write is a new object: it has none, or its window is over.
    fn creates(&self, entry: &Entry, now: Instant) -> bool {
        entry
            .object
            .as_ref()
            .is_none_or(|o| now >= o.created + self.policy.window)
    }

    /// When the pending entry may be written, the node's bucket aside: at once without an
    /// object; else when the object's patch bucket has a token, or when its window ends (then
    /// it is a new object), whichever comes first.
    fn ready_at(&self, entry: &Entry, now: Instant) -> Instant {
        match &entry.object {
            Some(object) => object
                .patches
                .next_at(now, self.policy.patch_burst, self.policy.patch_interval)
                .min(object.created + self.policy.window),
            None => entry.pending_since,
        }
    }
}

/// Where [`run`] sends its writes: the API server ([`KubeClient`]), or a fake in tests.
pub trait EventSink {
    /// Creates an Event object for `count` occurrences; returns its name.
    /// Creates the Event `name` (chosen by the caller and kept across retries of one write, so
    /// that a try whose answer was lost cannot make a second object: the retry gets 409, and
    /// [`run`] patches the stored one); returns its name.
    fn create(
        &self,
        event: &NodeEvent,
        name: &str,
        count: u64,
        first: SystemTime,
        last: SystemTime,
    ) -> impl Future<Output = Result<String, KubeError>> + Send;

    /// Sets the object's `count`, `message` (the event's) and `lastTimestamp`.
    fn patch(
        &self,
        event: &NodeEvent,
        name: &str,
        count: u64,
        last: SystemTime,
    ) -> impl Future<Output = Result<(), KubeError>> + Send;
}

impl EventSink for KubeClient {
    fn create(
        &self,
        event: &NodeEvent,
        name: &str,
        count: u64,
        first: SystemTime,
        last: SystemTime,
    ) -> impl Future<Output = Result<String, KubeError>> + Send {
        self.create_event_counted(event, name, count, first, last)
    }

    fn patch(
        &self,
        event: &NodeEvent,
        name: &str,
        count: u64,
        last: SystemTime,
    ) -> impl Future<Output = Result<(), KubeError>> + Send {
        self.patch_event(event, name, count, last)
    }
}

/// An Event asked for: type, reason, message.
pub type EventRequest = (EventType, String, String);

/// Posts the Events asked for on `requests` about the Node `node_name` (its uid read from
/// `node_rx` at each write), as [`Aggregator`] allows under `policy`. Failed writes that are
/// worth retrying (429, 5xx, no connection) keep their occurrences and wait for the server's
/// `Retry-After` or the next `backoff` step; a 404 on a patch (the Event expired) makes a new
/// object. Ends when `requests` closes.
pub async fn run<S: EventSink>(
    sink: S,
    node_name: String,
    node_rx: watch::Receiver<NodeView>,
    mut requests: mpsc::UnboundedReceiver<EventRequest>,
    policy: Policy,
    mut backoff: Backoff,
) {
    let mut aggregator = Aggregator::new(policy, Instant::now());
    // The name of each create being tried, by type and reason, until it is answered.
    let mut naming: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    loop {
        while let Some(write) = aggregator.next_write(Instant::now()) {
            let event = NodeEvent {
                node_name: node_name.clone(),
                node_uid: node_rx
                    .borrow()
                    .node
                    .as_ref()
                    .map(|n| n.uid.clone())
                    .unwrap_or_default(),
                event_type: write.event_type,
                reason: write.reason.clone(),
                message: write.message.clone(),
            };
            let key = format!("{:?}/{}", write.event_type, write.reason);
            let result = match &write.target {
                Target::Create => {
                    let name = naming.entry(key.clone()).or_insert_with(|| event_name(&node_name));
                    let (first, last) = (wall_time(write.first), wall_time(write.last));
                    match sink.create(&event, name, write.count, first, last).await {
                        // The name is ours: an earlier try of this write was stored and its
                        // answer lost (a timeout, a cut connection). No second object: set the
                        // stored one's count to this write's (it may hold an older one).
                        Err(e) if e.status_code() == Some(409) => sink
                            .patch(&event, name, write.count, last)
                            .await
                            .map(|()| Some(name.clone())),
                        other => other.map(Some),
                    }
                }
                Target::Patch { name } => sink
                    .patch(&event, name, write.count, wall_time(write.last))
                    .await
                    .map(|()| None),
            };
            if !matches!(&result, Err(e) if e.is_transient() || e.is_unauthorized()) {
                naming.remove(&key);
            }
            match result {
                Ok(created) => {
                    backoff.reset();
                    match created {
                        Some(name) => aggregator.created(&write, name, Instant::now()),
                        None => aggregator.patched(&write),
                    }
                }
                Err(e) if e.is_not_found() && matches!(write.target, Target::Patch { .. }) => {
                    tracing::info!(
                        "{e}: the {} Event is gone (expired?); a new one takes its count",
                        write.reason
                    );
                    aggregator.gone(&write);
                }
                Err(e) if e.is_transient() || e.is_unauthorized() => {
                    let delay = backoff.next_with(e.retry_after());
                    tracing::warn!(
                        "{e}; {} occurrence(s) of {} wait, trying again in {delay:?}",
                        write.adds,
                        write.reason
                    );
                    aggregator.failed(Instant::now() + delay);
                }
                Err(e) => {
                    let dropped = aggregator.rejected(&write);
                    tracing::warn!("{e}; {dropped} occurrence(s) of {} not posted", write.reason);
                }
            }
            // What arrived meanwhile joins its key before the next write is chosen.
            loop {
                match requests.try_recv() {
                    Ok(request) => record(&mut aggregator, request),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
        }
        let due = aggregator.next_due(Instant::now());
        let wake = async {
            match due {
                Some(due) => tokio::time::sleep_until(due.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            request = requests.recv() => match request {
                Some(request) => record(&mut aggregator, request),
                None => return,
            },
            () = wake => {}
        }
    }
}

fn record(aggregator: &mut Aggregator, (event_type, reason, message): EventRequest) {
    if let Some(forgotten) = aggregator.record(event_type, &reason, &message, Instant::now()) {
        if forgotten.pending > 0 {
            tracing::warn!(
                "more than the remembered Event reasons: forgot {} and {} occurrence(s) not posted yet",
                forgotten.reason,
                forgotten.pending
            );
        } else {
            tracing::info!(
                "more than the remembered Event reasons: forgot {} (idle longest)",
                forgotten.reason
            );
        }
    }
}

/// The wall-clock time of an earlier instant.
/// A new Event's name: `<node>.<unix time in nanoseconds, hex>`, as client-go names its Events.
fn event_name(node: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{node}.{nanos:x}")
}

fn wall_time(at: Instant) -> SystemTime {
    let now = SystemTime::now();
    now.checked_sub(Instant::now().saturating_duration_since(at))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::{ApiFailure, HttpFailure};
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    const SEC: Duration = Duration::from_secs(1);
    const MIN: Duration = Duration::from_secs(60);
    const W: EventType = EventType::Warning;

    /// An Event object on the fake server.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Object {
        name: String,
        reason: String,
        count: u64,
        message: String,
    }

    /// A fake API server: its Event objects, and when each create and patch was made.
    #[derive(Debug, Default)]
    struct Server {
        objects: Vec<Object>,
        creates: Vec<Instant>,
        patches: Vec<Instant>,
    }

    impl Server {
        fn counts(&self, reason: &str) -> Vec<u64> {
            self.objects
                .iter()
                .filter(|o| o.reason == reason)
                .map(|o| o.count)
                .collect()
        }
    }

    /// Makes every write the aggregator allows at `now`; all succeed.
    fn flush(agg: &mut Aggregator, server: &mut Server, now: Instant) {
        while let Some(w) = agg.next_write(now) {
            match &w.target {
                Target::Create => {
                    let name = format!("gpu-1.{}", server.objects.len());
                    server.objects.push(Object {
                        name: name.clone(),
                        reason: w.reason.clone(),
                        count: w.count,
                        message: w.message.clone(),
                    });
                    server.creates.push(now);
                    agg.created(&w, name, now);
                }
                Target::Patch { name } => {
                    let object = server
                        .objects
                        .iter_mut()
                        .find(|o| &o.name == name)
                        .expect("patching an object that was created");
                    assert!(w.count > object.count, "a patch raises the count: {w:?}");
                    object.count = w.count;
                    object.message = w.message.clone();
                    server.patches.push(now);
                    agg.patched(&w);
                }
            }
        }
    }

    /// Lets time pass, making each write when it is due, until nothing waits; returns the time
    /// then. A due time at which nothing may be written would loop: that fails the test.
    fn settle(agg: &mut Aggregator, server: &mut Server, mut now: Instant) -> Instant {
        for _ in 0..100_000 {
            let Some(due) = agg.next_due(now) else {
                return now;
            };
            now = now.max(due);
            flush(agg, server, now);
        }
        panic!("the aggregator makes no progress: {agg:?}");
    }

    fn roomy() -> Policy {
        Policy {
            burst: 10_000,
            ..Policy::default()
        }
    }

    #[test]
    fn a_thousand_repeats_in_the_window_are_one_object_with_the_exact_count() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        let mut server = Server::default();
        // A stage failing every half second for 500 s (inside the 10 minutes).
        for i in 0..1000u32 {
            let now = t0 + i * SEC / 2;
            agg.record(W, "DriverFailed", &format!("attempt {i}"), now);
            flush(&mut agg, &mut server, now);
        }
        assert_eq!(
            server.creates,
            [t0],
            "the first occurrence is posted at once, and only it"
        );
        settle(&mut agg, &mut server, t0 + 500 * SEC);
        assert_eq!(server.counts("DriverFailed"), [1000]);
        assert_eq!(server.objects[0].message, "attempt 999", "the latest message");
        assert_eq!(agg.pending(), 0);
        // Three patches follow at once; then at most one a minute.
        assert_eq!(server.patches[..3], [t0 + SEC / 2, t0 + SEC, t0 + 3 * SEC / 2]);
        for pair in server.patches[3..].windows(2) {
            assert!(pair[1] - pair[0] >= MIN, "{:?}", server.patches);
        }
        for four in server.patches.windows(4) {
            assert!(four[3] - four[0] >= MIN, "never 4 in a minute: {:?}", server.patches);
        }
        assert!(server.patches.len() <= 3 + 9, "{:?}", server.patches);
    }

    #[test]
    fn a_repeat_after_the_window_is_a_new_object() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        let mut server = Server::default();
        agg.record(W, "MigConfigFailed", "first", t0);
        flush(&mut agg, &mut server, t0);
        agg.record(W, "MigConfigFailed", "second", t0 + 5 * MIN);
        flush(&mut agg, &mut server, t0 + 5 * MIN);
        assert_eq!(server.counts("MigConfigFailed"), [2]);
        let later = t0 + 10 * MIN + SEC;
        agg.record(W, "MigConfigFailed", "third", later);
        flush(&mut agg, &mut server, later);
        assert_eq!(server.counts("MigConfigFailed"), [2, 1]);
        assert_eq!(server.objects[1].message, "third");
        assert_eq!(server.creates, [t0, later]);
    }

    #[test]
    fn a_repeat_not_patched_before_the_window_ends_goes_into_the_next_object() {
        let policy = Policy {
            patch_burst: 1,
            ..Policy::default()
        };
        let t0 = Instant::now();
        let mut agg = Aggregator::new(policy, t0);
        let mut server = Server::default();
        agg.record(W, "DriverFailed", "a", t0);
        flush(&mut agg, &mut server, t0);
        // Patched at 9:30; the next patch could come at 10:30, but the window ends at 10:00.
        let t = t0 + 9 * MIN + 30 * SEC;
        agg.record(W, "DriverFailed", "b", t);
        flush(&mut agg, &mut server, t);
        agg.record(W, "DriverFailed", "c", t + 15 * SEC);
        flush(&mut agg, &mut server, t + 15 * SEC);
        assert_eq!(agg.next_due(t + 15 * SEC), Some(t0 + 10 * MIN));
        settle(&mut agg, &mut server, t + 15 * SEC);
        assert_eq!(server.counts("DriverFailed"), [2, 1], "3 occurrences, none lost");
        assert_eq!(server.creates, [t0, t0 + 10 * MIN]);
    }

    #[test]
    fn the_token_bucket_allows_a_burst_of_25_then_one_write_every_5_minutes() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        let mut server = Server::default();
        for i in 0..30 {
            agg.record(W, &format!("Reason{i}"), "m", t0);
        }
        flush(&mut agg, &mut server, t0);
        assert_eq!(server.creates.len(), 25);
        assert_eq!(agg.pending(), 5);
        assert_eq!(agg.next_due(t0), Some(t0 + 5 * MIN));
        flush(&mut agg, &mut server, t0 + 5 * MIN - SEC);
        assert_eq!(server.creates.len(), 25, "no token before 5 minutes");
        settle(&mut agg, &mut server, t0);
        let late: Vec<Duration> = server.creates[25..].iter().map(|t| *t - t0).collect();
        assert_eq!(late, [5 * MIN, 10 * MIN, 15 * MIN, 20 * MIN, 25 * MIN]);
        assert_eq!(server.objects.len(), 30);
        assert!(server.objects.iter().all(|o| o.count == 1));
    }

    #[test]
    fn two_hours_of_failures_every_second_stay_within_the_rate_and_add_up() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        let mut server = Server::default();
        let seconds = 2 * 3600u32;
        for i in 0..seconds {
            let now = t0 + i * SEC;
            agg.record(W, "DriverFailed", "driver 550 does not load", now);
            flush(&mut agg, &mut server, now);
        }
        settle(&mut agg, &mut server, t0 + seconds * SEC);
        let counts = server.counts("DriverFailed");
        assert_eq!(counts.iter().sum::<u64>(), u64::from(seconds));
        // At most one object per 10 minutes, and writes within 25 + one per 5 minutes.
        for pair in server.creates.windows(2) {
            assert!(pair[1] - pair[0] >= 10 * MIN, "{:?}", server.creates);
        }
        let writes = server.creates.len() + server.patches.len();
        assert!(writes <= 25 + 2 * 12 + 1, "{writes} writes");
    }

    #[test]
    fn new_reasons_go_before_count_bumps_when_tokens_are_scarce() {
        let policy = Policy {
            burst: 2,
            window: Duration::from_secs(3600),
            ..Policy::default()
        };
        let t0 = Instant::now();
        let mut agg = Aggregator::new(policy, t0);
        let mut server = Server::default();
        // Both tokens spent: A created, then bumped.
        agg.record(W, "A", "1", t0);
        flush(&mut agg, &mut server, t0);
        agg.record(W, "A", "2", t0 + SEC);
        flush(&mut agg, &mut server, t0 + SEC);
        assert_eq!(server.counts("A"), [2]);
        // A waits longer, but B's first Event takes the next token (5 minutes after the first
        // was taken), A's bump the one after.
        agg.record(W, "A", "3", t0 + 2 * SEC);
        agg.record(W, "B", "1", t0 + 3 * SEC);
        flush(&mut agg, &mut server, t0 + 3 * SEC);
        assert_eq!(server.objects.len(), 1);
        settle(&mut agg, &mut server, t0 + 3 * SEC);
        assert_eq!(server.objects[1].reason, "B");
        assert_eq!(server.creates, [t0, t0 + 5 * MIN]);
        assert_eq!(server.patches, [t0 + SEC, t0 + 10 * MIN]);
        assert_eq!(server.counts("A"), [3]);
    }

    #[test]
    fn after_a_burst_of_three_an_object_is_patched_at_most_once_a_minute() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(roomy(), t0);
        let mut server = Server::default();
        for i in 0..6u32 {
            agg.record(W, "A", &format!("m{i}"), t0 + i * SEC);
            flush(&mut agg, &mut server, t0 + i * SEC);
        }
        assert_eq!(server.creates, [t0]);
        assert_eq!(server.patches, [t0 + SEC, t0 + 2 * SEC, t0 + 3 * SEC]);
        // The first patch token comes back a minute after it was taken.
        assert_eq!(agg.next_due(t0 + 5 * SEC), Some(t0 + SEC + MIN));
        flush(&mut agg, &mut server, t0 + MIN);
        assert_eq!(server.patches.len(), 3);
        flush(&mut agg, &mut server, t0 + SEC + MIN);
        assert_eq!(server.patches[3], t0 + SEC + MIN);
        assert_eq!(server.counts("A"), [6]);
        assert_eq!(server.objects[0].message, "m5");
        // Then one a minute.
        agg.record(W, "A", "m6", t0 + SEC + MIN);
        assert_eq!(agg.next_due(t0 + SEC + MIN), Some(t0 + SEC + 2 * MIN));
        settle(&mut agg, &mut server, t0 + SEC + MIN);
        assert_eq!(server.patches[4], t0 + SEC + 2 * MIN);
    }

    #[test]
    fn distinct_reasons_and_types_are_separate_objects() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        let mut server = Server::default();
        agg.record(W, "A", "m", t0);
        agg.record(W, "B", "m", t0);
        agg.record(EventType::Normal, "A", "m", t0);
        agg.record(W, "A", "m", t0);
        settle(&mut agg, &mut server, t0);
        assert_eq!(server.objects.len(), 3);
        assert_eq!(server.counts("A"), [2, 1]);
        assert_eq!(server.counts("B"), [1]);
        assert_eq!(agg.keys(), 3);
    }

    #[test]
    fn at_most_max_keys_are_held_and_the_one_idle_longest_is_forgotten() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(roomy(), t0);
        let mut server = Server::default();
        for i in 0..64u32 {
            assert_eq!(agg.record(W, &format!("R{i}"), "m", t0 + i * SEC), None);
            flush(&mut agg, &mut server, t0 + i * SEC);
        }
        // R0 is seen again: R1 is now the one idle longest.
        agg.record(W, "R0", "m", t0 + 64 * SEC);
        let forgotten = agg.record(W, "R64", "m", t0 + 65 * SEC);
        assert_eq!(
            forgotten,
            Some(Forgotten {
                event_type: W,
                reason: "R1".into(),
                pending: 0
            })
        );
        assert_eq!(agg.keys(), 64);
        settle(&mut agg, &mut server, t0 + 65 * SEC);
        assert_eq!(server.counts("R0"), [2]);
        assert_eq!(server.counts("R64"), [1]);
        // A forgotten reason starts over with a new object.
        agg.record(W, "R1", "m", t0 + 66 * SEC);
        settle(&mut agg, &mut server, t0 + 66 * SEC);
        assert_eq!(server.counts("R1"), [1, 1]);
    }

    #[test]
    fn with_every_key_waiting_the_oldest_is_forgotten_with_its_count() {
        let policy = Policy {
            burst: 0,
            max_keys: 2,
            ..Policy::default()
        };
        let t0 = Instant::now();
        let mut agg = Aggregator::new(policy, t0);
        agg.record(W, "A", "m", t0);
        agg.record(W, "A", "m", t0 + SEC);
        agg.record(W, "B", "m", t0 + 2 * SEC);
        let forgotten = agg.record(W, "C", "m", t0 + 3 * SEC);
        assert_eq!(
            forgotten,
            Some(Forgotten {
                event_type: W,
                reason: "A".into(),
                pending: 2
            })
        );
        assert_eq!(agg.pending(), 2);
    }

    #[test]
    fn a_failed_write_keeps_its_count_and_holds_writes_until_the_retry() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        let mut server = Server::default();
        agg.record(W, "A", "m", t0);
        let write = agg.next_write(t0).expect("the first Event goes at once");
        assert_eq!((write.target.clone(), write.count), (Target::Create, 1));
        agg.failed(t0 + 30 * SEC);
        agg.record(W, "A", "m2", t0 + 10 * SEC);
        assert_eq!(agg.next_write(t0 + 10 * SEC), None);
        assert_eq!(agg.next_due(t0 + 10 * SEC), Some(t0 + 30 * SEC));
        flush(&mut agg, &mut server, t0 + 30 * SEC);
        assert_eq!(server.counts("A"), [2]);
        assert_eq!(server.objects[0].message, "m2");
    }

    #[test]
    fn a_gone_object_is_replaced_by_one_for_the_occurrences_not_written() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        let mut server = Server::default();
        agg.record(W, "A", "m", t0);
        flush(&mut agg, &mut server, t0);
        agg.record(W, "A", "m", t0 + SEC);
        agg.record(W, "A", "m", t0 + 2 * SEC);
        let write = agg.next_write(t0 + 2 * SEC).expect("a patch");
        assert_eq!(write.target, Target::Patch { name: "gpu-1.0".into() });
        assert_eq!((write.count, write.adds), (3, 2));
        agg.gone(&write);
        let write = agg.next_write(t0 + 2 * SEC).expect("a create");
        assert_eq!((write.target.clone(), write.count, write.adds), (Target::Create, 2, 2));
        assert_eq!((write.first, write.last), (t0 + SEC, t0 + 2 * SEC));
    }

    #[test]
    fn a_rejected_write_drops_its_count() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        agg.record(W, "A", "m", t0);
        let write = agg.next_write(t0).expect("a create");
        assert_eq!(agg.rejected(&write), 1);
        assert_eq!(agg.pending(), 0);
        assert_eq!(agg.next_due(t0), None);
    }

    #[test]
    fn nothing_pending_needs_no_timer() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        assert_eq!(agg.next_due(t0), None);
        let mut server = Server::default();
        agg.record(W, "A", "m", t0);
        assert_eq!(agg.next_due(t0), Some(t0));
        flush(&mut agg, &mut server, t0);
        assert_eq!(agg.next_due(t0), None);
    }

    #[test]
    fn messages_are_kept_at_most_as_long_as_an_event_takes() {
        let t0 = Instant::now();
        let mut agg = Aggregator::new(Policy::default(), t0);
        agg.record(W, "A", &"é".repeat(MAX_EVENT_MESSAGE), t0);
        let write = agg.next_write(t0).expect("a create");
        assert_eq!(write.message.len(), MAX_EVENT_MESSAGE);
    }

    /// A fake API server for [`run`]: Event objects by name, and HTTP codes to fail the next
    /// writes with.
    #[derive(Clone, Default)]
    struct FakeSink {
        state: Arc<Mutex<FakeState>>,
    }

    #[derive(Default)]
    struct FakeState {
        objects: Vec<Object>,
        created: usize,
        fail: VecDeque<u16>,
        /// The next create is stored but answered with a 504, as if the answer were lost.
        lose_next_answer: bool,
        /// Every call: `create` or `patch NAME`, with the code answered.
        calls: Vec<(String, u16)>,
    }

    fn http(code: u16) -> ApiFailure {
        ApiFailure::Http(Box::new(HttpFailure {
            code,
            status: None,
            retry_after: None,
            body: String::new(),
        }))
    }

    impl EventSink for FakeSink {
        async fn create(
            &self,
            event: &NodeEvent,
            name: &str,
            count: u64,
            _first: SystemTime,
            _last: SystemTime,
        ) -> Result<String, KubeError> {
            let mut state = self.state.lock().expect("fake");
            let fail = |code| KubeError::CreateEvent {
                name: event.node_name.clone(),
                reason: event.reason.clone(),
                path: "/api/v1/namespaces/default/events".into(),
                failure: http(code),
            };
            if state.objects.iter().any(|o| o.name == name) {
                state.calls.push(("create".into(), 409));
                return Err(fail(409));
            }
            if state.lose_next_answer {
                // Stored, but the answer never arrives (a timeout, a cut connection).
                state.lose_next_answer = false;
                state.calls.push(("create".into(), 504));
                state.objects.push(Object {
                    name: name.to_owned(),
                    reason: event.reason.clone(),
                    count,
                    message: event.message.clone(),
                });
                return Err(fail(504));
            }
            if let Some(code) = state.fail.pop_front() {
                state.calls.push(("create".into(), code));
                return Err(KubeError::CreateEvent {
                    name: event.node_name.clone(),
                    reason: event.reason.clone(),
                    path: "/api/v1/namespaces/default/events".into(),
                    failure: http(code),
                });
            }
            state.created += 1;
            let name = name.to_owned();
            state.calls.push(("create".into(), 201));
            state.objects.push(Object {
                name: name.clone(),
                reason: event.reason.clone(),
                count,
                message: event.message.clone(),
            });
            Ok(name)
        }

        async fn patch(&self, event: &NodeEvent, name: &str, count: u64, _last: SystemTime) -> Result<(), KubeError> {
            let mut state = self.state.lock().expect("fake");
            let exists = state.objects.iter().any(|o| o.name == name);
            let code = match state.fail.pop_front() {
                Some(code) => code,
                None if exists => 200,
                None => 404,
            };
            state.calls.push((format!("patch {name}"), code));
            if code != 200 {
                return Err(KubeError::PatchEvent {
                    name: event.node_name.clone(),
                    event: name.to_owned(),
                    path: format!("/api/v1/namespaces/default/events/{name}"),
                    failure: http(code),
                });
            }
            if let Some(object) = state.objects.iter_mut().find(|o| o.name == name) {
                object.count = count;
                object.message = event.message.clone();
            }
            Ok(())
        }
    }

    impl FakeSink {
        /// Waits (up to 20 s) until `pred` holds for the fake's objects.
        async fn until(&self, what: &str, pred: impl Fn(&[Object]) -> bool) {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                {
                    let state = self.state.lock().expect("fake");
                    if pred(&state.objects) {
                        return;
                    }
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "{what}: objects {:?}, calls {:?}",
                        state.objects,
                        state.calls
                    );
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    fn spawn_run(sink: &FakeSink) -> (mpsc::UnboundedSender<EventRequest>, watch::Sender<NodeView>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (node_tx, node_rx) = watch::channel(NodeView {
            node: None,
            connected: true,
            error: None,
            mode: crate::kube::SyncMode::Watch,
        });
        let policy = Policy {
            window: Duration::from_secs(3600),
            burst: 1000,
            refill: Duration::from_millis(1),
            patch_interval: Duration::from_millis(1),
            patch_burst: 3,
            max_keys: 64,
        };
        let backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(20));
        tokio::spawn(run(sink.clone(), "gpu-1".into(), node_rx, rx, policy, backoff));
        (tx, node_tx)
    }

    fn send(tx: &mpsc::UnboundedSender<EventRequest>, reason: &str, message: &str) {
        tx.send((W, reason.into(), message.into())).expect("the task runs");
    }

    #[tokio::test]
    async fn an_expired_event_is_replaced_by_a_new_object_for_what_was_not_written() {
        let sink = FakeSink::default();
        let (tx, _node) = spawn_run(&sink);
        send(&tx, "DriverFailed", "one");
        sink.until("the first Event", |o| o.len() == 1 && o[0].count == 1).await;
        send(&tx, "DriverFailed", "two");
        sink.until("the bump", |o| o.len() == 1 && o[0].count == 2).await;
        // The API server's --event-ttl deletes it.
        sink.state.lock().expect("fake").objects.clear();
        let first_name = sink.state.lock().expect("fake").calls.len();
        send(&tx, "DriverFailed", "three");
        sink.until("a new object", |o| o.len() == 1).await;
        assert!(first_name > 0);
        let state = sink.state.lock().expect("fake");
        assert_eq!(state.objects[0].count, 1, "only the occurrence the old object lacks");
        assert_eq!(state.objects[0].message, "three");
        let codes: Vec<u16> = state.calls.iter().map(|c| c.1).collect();
        assert_eq!(codes, [201, 200, 404, 201], "{:?}", state.calls);
    }

    #[tokio::test]
    async fn transient_failures_keep_the_count_and_are_retried() {
        let sink = FakeSink::default();
        let (tx, _node) = spawn_run(&sink);
        sink.state.lock().expect("fake").fail.extend([503, 500]);
        send(&tx, "MigConfigFailed", "one");
        send(&tx, "MigConfigFailed", "two");
        sink.until("posted after the failures", |o| o.len() == 1 && o[0].count == 2)
            .await;
        // A refused write (403) is dropped, and the next occurrence still goes out.
        sink.state.lock().expect("fake").fail.push_back(403);
        send(&tx, "MigConfigFailed", "three");
        send(&tx, "MigConfigFailed", "four");
        sink.until("the next occurrence", |o| o[0].message == "four").await;
        assert_eq!(sink.state.lock().expect("fake").objects[0].count, 3, "two, and four");
        let state = sink.state.lock().expect("fake");
        let codes: Vec<u16> = state.calls.iter().map(|c| c.1).collect();
        assert_eq!(&codes[..3], [503, 500, 201], "{:?}", state.calls);
        assert_eq!(codes[3], 403, "{:?}", state.calls);
    }

    #[tokio::test]
    async fn a_create_whose_answer_was_lost_is_not_made_twice() {
        let sink = FakeSink::default();
        let (tx, _node) = spawn_run(&sink);
        sink.state.lock().expect("fake").lose_next_answer = true;
        send(&tx, "DriverFailed", "one");
        sink.until("stored, the answer lost", |o| o.len() == 1).await;
        send(&tx, "DriverFailed", "two");
        sink.until("the count", |o| o.first().is_some_and(|o| o.count == 2))
            .await;
        let state = sink.state.lock().expect("fake");
        assert_eq!(state.objects.len(), 1, "one object: {:?}", state.objects);
        let codes: Vec<u16> = state.calls.iter().map(|c| c.1).collect();
        assert_eq!(codes[..2], [504, 409], "retried under the same name: {:?}", state.calls);
        assert!(state.objects[0].name.starts_with("gpu-1."), "{}", state.objects[0].name);
    }
}
