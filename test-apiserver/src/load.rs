//! Load statistics (the API server's view of a fleet of clients) and the max-in-flight limit.
//!
//! Counting happens on every request, so it is a fixed table of atomics indexed by (verb,
//! resource), plus one short lock for the per-user counts that allocates only for a user not
//! seen before.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use crate::State;
use crate::http::Body;

/// The verbs counted apart; any other method is counted as `other`.
const VERBS: [&str; 9] = [
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
    "other",
];
/// The resources served; `""` is everything else (`/version`, unknown paths).
const RESOURCES: [&str; 6] = [
    "nodes",
    "events",
    "runtimeclasses",
    "resourceslices",
    "resourceclaims",
    "",
];

/// Requests and bytes for one (verb, resource) pair, since the start or the last
/// [`clear_stats`](crate::TestApiServer::clear_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests received (authenticated or not; a watch counts once, when it starts).
    pub requests: u64,
    /// Request body bytes received.
    pub request_bytes: u64,
    /// Response body bytes sent (headers and TLS/HTTP framing not included). A watch's bytes
    /// are counted as each event is handed to the connection, so they grow while it is open.
    pub response_bytes: u64,
    /// 429 answers sent, whatever the cause ([`Failure::TooManyRequests`](crate::Failure) or
    /// the max-in-flight limit).
    pub too_many_requests: u64,
    /// Watch streams open now (a gauge: not reset by `clear_stats`).
    pub open_watches: u64,
    /// The most watch streams open at once since the last `clear_stats` (which sets it to the
    /// number open then).
    pub peak_watches: u64,
}

impl Load {
    fn add(&mut self, other: &Load) {
        self.requests += other.requests;
        self.request_bytes += other.request_bytes;
        self.response_bytes += other.response_bytes;
        self.too_many_requests += other.too_many_requests;
        self.open_watches += other.open_watches;
        self.peak_watches += other.peak_watches;
    }

    fn is_empty(&self) -> bool {
        *self == Load::default()
    }
}

/// What the server has seen, from [`TestApiServer::stats`](crate::TestApiServer::stats).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// By (Kubernetes verb, resource): verbs as in [`RequestRecord::verb`](crate::RequestRecord)
    /// (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`,
    /// and `other` for any other method); resources as the plural without group (`nodes`,
    /// `events`, `runtimeclasses`, `resourceslices`, `resourceclaims`, and `""` for `/version`
    /// and unknown paths). Only pairs with something to show are present.
    pub by_verb_resource: BTreeMap<(String, String), Load>,
    /// Requests per authenticated user name (`system:node:gpu-3`); unauthenticated requests
    /// are not in it.
    pub by_user: BTreeMap<String, u64>,
    /// Watch streams open now, all resources together.
    pub open_watches: u64,
    /// The most watch streams open at once (all together) since the last `clear_stats`.
    pub peak_watches: u64,
    /// Read-only requests (`get`, `list`) being served now (authenticated ones, until their
    /// answer is ready): what the max-in-flight limit counts. Counted with no limit set too.
    pub readonly_in_flight: u64,
    /// Mutating requests being served now, likewise.
    pub mutating_in_flight: u64,
}

impl Stats {
    /// The load for one (verb, resource) pair; zero when there was none.
    pub fn load(&self, verb: &str, resource: &str) -> Load {
        self.by_verb_resource
            .iter()
            .find(|((v, r), _)| v == verb && r == resource)
            .map(|(_, load)| *load)
            .unwrap_or_default()
    }

    /// Everything together. `open_watches` and `peak_watches` are the server-wide figures (the
    /// peak of the sum, not the sum of the peaks).
    pub fn total(&self) -> Load {
        let mut total = Load::default();
        for load in self.by_verb_resource.values() {
            total.add(load);
        }
        total.open_watches = self.open_watches;
        total.peak_watches = self.peak_watches;
        total
    }

    /// The user that sent the most requests, and how many: "the busiest node".
    pub fn busiest_user(&self) -> Option<(&str, u64)> {
        self.by_user
            .iter()
            .max_by_key(|(user, n)| (**n, std::cmp::Reverse(user.as_str())))
            .map(|(user, n)| (user.as_str(), *n))
    }
}

impl fmt::Display for Stats {
    /// A table, one (verb, resource) pair a line, then the totals and the busiest user.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<17} {:<15} {:>10} {:>14} {:>14} {:>8} {:>7} {:>7}",
            "verb", "resource", "requests", "bytes in", "bytes out", "429", "watches", "peak"
        )?;
        let line = |f: &mut fmt::Formatter<'_>, verb: &str, resource: &str, l: &Load| {
            writeln!(
                f,
                "{verb:<17} {resource:<15} {:>10} {:>14} {:>14} {:>8} {:>7} {:>7}",
                l.requests, l.request_bytes, l.response_bytes, l.too_many_requests, l.open_watches, l.peak_watches
            )
        };
        for ((verb, resource), load) in &self.by_verb_resource {
            line(f, verb, if resource.is_empty() { "-" } else { resource }, load)?;
        }
        line(f, "total", "", &self.total())?;
        match self.busiest_user() {
            Some((user, n)) => write!(f, "busiest user: {user} ({n} requests of {})", self.by_user.len()),
            None => write!(f, "busiest user: none"),
        }
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    request_bytes: AtomicU64,
    response_bytes: AtomicU64,
    too_many_requests: AtomicU64,
    open_watches: AtomicU64,
    peak_watches: AtomicU64,
}

/// Where one request is counted: an index into the table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot(usize);

/// The counters behind [`Stats`].
pub(crate) struct LoadTable {
    slots: Vec<Counters>,
    open_watches: AtomicU64,
    peak_watches: AtomicU64,
    users: Mutex<HashMap<String, u64>>,
}

impl LoadTable {
    pub fn new() -> LoadTable {
        LoadTable {
            slots: (0..VERBS.len() * RESOURCES.len())
                .map(|_| Counters::default())
                .collect(),
            open_watches: AtomicU64::new(0),
            peak_watches: AtomicU64::new(0),
            users: Mutex::new(HashMap::new()),
        }
    }

    pub fn slot(verb: &str, resource: &str) -> Slot {
        let v = VERBS.iter().position(|v| *v == verb).unwrap_or(VERBS.len() - 1);
        let r = RESOURCES
            .iter()
            .position(|r| *r == resource)
            .unwrap_or(RESOURCES.len() - 1);
        Slot(v * RESOURCES.len() + r)
    }

    /// A request arrived with a body of `body_len` bytes, from `user` if authenticated.
    pub fn request(&self, slot: Slot, body_len: usize, user: Option<&str>) {
        let c = &self.slots[slot.0];
        c.requests.fetch_add(1, Relaxed);
        c.request_bytes.fetch_add(body_len as u64, Relaxed);
        if let Some(user) = user {
            let mut users = self.users.lock().expect("stats users lock");
            match users.get_mut(user) {
                Some(n) => *n += 1,
                None => {
                    users.insert(user.to_owned(), 1);
                }
            }
        }
    }

    pub fn too_many_requests(&self, slot: Slot) {
        self.slots[slot.0].too_many_requests.fetch_add(1, Relaxed);
    }

    pub fn sent(&self, slot: Slot, bytes: usize) {
        self.slots[slot.0].response_bytes.fetch_add(bytes as u64, Relaxed);
    }

    fn watch_opened(&self, slot: Slot) {
        let c = &self.slots[slot.0];
        let open = c.open_watches.fetch_add(1, Relaxed) + 1;
        c.peak_watches.fetch_max(open, Relaxed);
        let open = self.open_watches.fetch_add(1, Relaxed) + 1;
        self.peak_watches.fetch_max(open, Relaxed);
    }

    fn watch_closed(&self, slot: Slot) {
        self.slots[slot.0].open_watches.fetch_sub(1, Relaxed);
        self.open_watches.fetch_sub(1, Relaxed);
    }

    pub fn snapshot(&self, limits: &InflightLimits) -> Stats {
        let mut by_verb_resource = BTreeMap::new();
        for (i, c) in self.slots.iter().enumerate() {
            let load = Load {
                requests: c.requests.load(Relaxed),
                request_bytes: c.request_bytes.load(Relaxed),
                response_bytes: c.response_bytes.load(Relaxed),
                too_many_requests: c.too_many_requests.load(Relaxed),
                open_watches: c.open_watches.load(Relaxed),
                peak_watches: c.peak_watches.load(Relaxed),
            };
            if !load.is_empty() {
                let (verb, resource) = (VERBS[i / RESOURCES.len()], RESOURCES[i % RESOURCES.len()]);
                by_verb_resource.insert((verb.to_owned(), resource.to_owned()), load);
            }
        }
        Stats {
            by_verb_resource,
            by_user: self
                .users
                .lock()
                .expect("stats users lock")
                .iter()
                .map(|(u, n)| (u.clone(), *n))
                .collect(),
            open_watches: self.open_watches.load(Relaxed),
            peak_watches: self.peak_watches.load(Relaxed),
            readonly_in_flight: limits.readonly.in_flight.load(Relaxed) as u64,
            mutating_in_flight: limits.mutating.in_flight.load(Relaxed) as u64,
        }
    }

    /// Zeroes the counters; open watches stay (they are still open) and become the new peaks.
    pub fn clear(&self) {
        for c in &self.slots {
            c.requests.store(0, Relaxed);
            c.request_bytes.store(0, Relaxed);
            c.response_bytes.store(0, Relaxed);
            c.too_many_requests.store(0, Relaxed);
            c.peak_watches.store(c.open_watches.load(Relaxed), Relaxed);
        }
        self.peak_watches.store(self.open_watches.load(Relaxed), Relaxed);
        self.users.lock().expect("stats users lock").clear();
    }
}

/// A response body whose size is not known up front (a watch, a generated oversized answer):
/// counts its bytes as they are handed to the connection, and for a watch, holds its place
/// among the open watches until the body is dropped (the stream ended or the client went).
pub(crate) struct Counted {
    inner: Body,
    state: Arc<State>,
    slot: Slot,
    watch: bool,
}

impl Counted {
    pub fn wrap(inner: Body, state: Arc<State>, slot: Slot, watch: bool) -> Body {
        if watch {
            state.load.watch_opened(slot);
        }
        Counted {
            inner,
            state,
            slot,
            watch,
        }
        .boxed_unsync()
    }
}

impl HttpBody for Counted {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.state.load.sent(self.slot, data.len());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.watch {
            self.state.load.watch_closed(self.slot);
        }
    }
}

/// One of kube-apiserver's two in-flight budgets (`--max-requests-inflight`,
/// `--max-mutating-requests-inflight`).
#[derive(Default)]
pub(crate) struct Budget {
    /// 0: no limit (as upstream, where 0 disables it).
    limit: AtomicUsize,
    in_flight: AtomicUsize,
}

/// The max-in-flight filter's two budgets.
#[derive(Default)]
pub(crate) struct InflightLimits {
    readonly: Budget,
    mutating: Budget,
}

/// A request's place in its budget, given back when dropped (the answer is ready, or the
/// client went away).
pub(crate) struct InflightGuard<'a>(Option<&'a AtomicUsize>);

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        if let Some(in_flight) = self.0 {
            in_flight.fetch_sub(1, Relaxed);
        }
    }
}

impl InflightLimits {
    pub fn set(&self, readonly: Option<usize>, mutating: Option<usize>) {
        self.readonly.limit.store(readonly.unwrap_or(0), Relaxed);
        self.mutating.limit.store(mutating.unwrap_or(0), Relaxed);
    }

    /// What upstream's `WithMaxInFlightLimit` decides for a request with this verb: `Some`
    /// guard to go on with, or `None` for a 429. Watches (long-running) are not counted; `get`,
    /// `list` (and `watch`) are read-only, every other verb mutating. `exempt` (a
    /// `system:masters` user) is served even when the budget is spent, without a place in it.
    pub fn admit(&self, verb: &str, exempt: bool) -> Option<InflightGuard<'_>> {
        let budget = match verb {
            "watch" => return Some(InflightGuard(None)),
            "get" | "list" => &self.readonly,
            _ => &self.mutating,
        };
        // Counted with no limit too: the stats show what is in flight.
        let limit = budget.limit.load(Relaxed);
        let taken = budget
            .in_flight
            .fetch_update(Relaxed, Relaxed, |n| (limit == 0 || n < limit).then_some(n + 1))
            .is_ok();
        if taken {
            Some(InflightGuard(Some(&budget.in_flight)))
        } else if exempt {
            Some(InflightGuard(None))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_cover_every_verb_and_resource() {
        let mut seen = std::collections::HashSet::new();
        for v in VERBS {
            for r in RESOURCES {
                let Slot(i) = LoadTable::slot(v, r);
                assert_eq!((VERBS[i / RESOURCES.len()], RESOURCES[i % RESOURCES.len()]), (v, r));
                assert!(seen.insert(i));
            }
        }
        assert_eq!(LoadTable::slot("options", "pods").0, LoadTable::slot("other", "").0);
    }

    #[test]
    fn budgets() {
        let limits = InflightLimits::default();
        limits.set(Some(1), None);
        let first = limits.admit("get", false).expect("first read");
        assert!(limits.admit("list", false).is_none(), "over the read-only budget");
        assert!(limits.admit("list", true).is_some(), "system:masters always served");
        assert!(limits.admit("watch", false).is_some(), "watches are not counted");
        assert!(
            limits.admit("patch", false).is_some(),
            "mutating has its own budget (none)"
        );
        drop(first);
        assert!(limits.admit("get", false).is_some());
        limits.set(Some(0), Some(1));
        let _write = limits.admit("create", false).expect("first write");
        assert!(limits.admit("delete", false).is_none());
        let reads: Vec<_> = (0..3).map(|_| limits.admit("get", false)).collect();
        assert!(reads.iter().all(Option::is_some), "0 is no limit, as upstream");
        assert_eq!(limits.readonly.in_flight.load(Relaxed), 3, "counted all the same");
        drop(reads);
        assert_eq!(limits.readonly.in_flight.load(Relaxed), 0);
    }
}
