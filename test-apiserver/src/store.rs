//! Objects, the global resourceVersion counter, the watch history and the open watches.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use bytes::Bytes;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::dra;
use crate::selector::Filter;
use crate::status::{ApiError, Cause};
use crate::time::now_rfc3339;
use crate::validate;

/// One recorded change to a Node. A deletion keeps the last state (with the deletion RV) in `obj`.
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    old: Option<Value>,
    obj: Value,
    deleted: bool,
}

/// An open watch: lines (`{"type":..,"object":..}\n`) go to the response body.
struct Watcher {
    tx: mpsc::UnboundedSender<Bytes>,
    filter: Filter,
    bookmarks: bool,
}

/// The open watches, indexed so that a change reaches only the watches that may see it: a watch
/// whose field selector requires `metadata.name=<x>` can only ever see node `x`, so it is kept
/// under `x`; every other watch is checked against every change. With one such watch per node
/// (what each kubelet-like client opens), a change costs one lookup instead of one selector check
/// per watch.
#[derive(Default)]
struct Watchers {
    by_name: HashMap<String, Vec<Watcher>>,
    others: Vec<Watcher>,
}

impl Watchers {
    fn add(&mut self, watcher: Watcher) {
        let list = match watcher.filter.fields.required("metadata.name") {
            Some(name) => self.by_name.entry(name.to_owned()).or_default(),
            None => &mut self.others,
        };
        // Prune where the new watch goes; other lists are pruned when they are next sent to.
        list.retain(|w| !w.tx.is_closed());
        list.push(watcher);
    }

    /// Keeps the watchers `keep` accepts, in every list; drops lists left empty.
    fn retain_all(&mut self, mut keep: impl FnMut(&Watcher) -> bool) {
        self.by_name.retain(|_, list| {
            list.retain(&mut keep);
            !list.is_empty()
        });
        self.others.retain(keep);
    }

    fn len(&self) -> usize {
        self.others.len() + self.by_name.values().map(Vec::len).sum::<usize>()
    }

    fn clear(&mut self) {
        self.by_name.clear();
        self.others.clear();
    }
}

/// Where a new watch starts.
pub(crate) enum WatchFrom {
    /// RV absent or "0": synthetic ADDED for what exists now.
    Now,
    /// Changes after this RV, from the history.
    After(u64),
}

pub(crate) struct Store {
    rv: u64,
    /// A watch from an RV below this is expired (410).
    floor: u64,
    nodes: BTreeMap<String, Value>,
    events: Vec<Value>,
    /// Where each Event is in `events`, by namespace and name (Events are never deleted).
    event_at: HashMap<String, HashMap<String, usize>>,
    /// `node.k8s.io/v1` RuntimeClasses by name (cluster-scoped).
    runtime_classes: BTreeMap<String, Value>,
    /// `resource.k8s.io/v1` ResourceSlices by name (cluster-scoped). Not in the watch history.
    resource_slices: BTreeMap<String, Value>,
    /// The names of the ResourceSlices with each `spec.nodeName`: a node lists its own slices
    /// (`fieldSelector=spec.nodeName=<n>`), and with thousands of nodes a scan of all is slow.
    slices_by_node: HashMap<String, BTreeSet<String>>,
    /// `resource.k8s.io/v1` ResourceClaims by (namespace, name).
    resource_claims: BTreeMap<(String, String), Value>,
    history: VecDeque<Change>,
    history_limit: usize,
    watchers: Watchers,
}

/// The server-set metadata of an object being created (`name`, a new `uid`, the creation time;
/// the RV is set when stored), as the template an update is prepared against; the client's
/// `resourceVersion`, `uid` and `creationTimestamp` are dropped from `obj`.
fn fresh_metadata(obj: &mut Value, name: &str) -> Value {
    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("resourceVersion");
        m.remove("uid");
        m.remove("creationTimestamp");
    }
    json!({"metadata": {
        "name": name,
        "uid": new_uid(),
        "resourceVersion": "0",
        "creationTimestamp": now_rfc3339(),
    }})
}

pub(crate) fn new_uid() -> String {
    let mut rng = fastrand::Rng::new();
    let hex = |n: usize, rng: &mut fastrand::Rng| -> String {
        (0..n)
            .map(|_| char::from_digit(rng.u32(0..16), 16).unwrap_or('0'))
            .collect()
    };
    format!(
        "{}-{}-4{}-{}{}-{}",
        hex(8, &mut rng),
        hex(4, &mut rng),
        hex(3, &mut rng),
        ['8', '9', 'a', 'b'][rng.usize(0..4)],
        hex(3, &mut rng),
        hex(12, &mut rng)
    )
}

fn generated_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| char::from(ALPHABET[fastrand::usize(..ALPHABET.len())]))
        .collect()
}

fn meta(obj: &Value) -> &Map<String, Value> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    obj.get("metadata")
        .and_then(Value::as_object)
        .unwrap_or_else(|| EMPTY.get_or_init(Map::new))
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> &'a str {
    meta(obj).get(field).and_then(Value::as_str).unwrap_or_default()
}

/// The object as a list item: list responses leave out `kind` and `apiVersion`.
fn list_item(obj: &Value) -> Value {
    let mut item = obj.clone();
    if let Some(m) = item.as_object_mut() {
        m.remove("kind");
        m.remove("apiVersion");
    }
    item
}

fn watch_line(kind: &str, obj: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": obj})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark_line(rv: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    watch_line(
        "BOOKMARK",
        &json!({"kind": "Node", "apiVersion": "v1", "metadata": metadata}),
    )
}

/// What a watcher with `filter` sees of `change`, if anything.
fn event_for<'a>(filter: &Filter, change: &'a Change) -> Option<(&'static str, &'a Value)> {
    let new_matches = !change.deleted && filter.matches(&change.obj);
    let old_matches = change.old.as_ref().is_some_and(|o| filter.matches(o));
    match (old_matches, new_matches) {
        (false, true) => Some(("ADDED", &change.obj)),
        (true, true) => Some(("MODIFIED", &change.obj)),
        (true, false) => Some(("DELETED", &change.obj)),
        (false, false) => None,
    }
}

/// Checks the shape of an incoming object and puts the server-owned fields back from `current`.
/// Preconditions (`resourceVersion`, `uid`) are checked first, as the API server does.
fn prepare_update(
    resource: &str,
    kind: &str,
    api_version: &str,
    name: &str,
    current: &Value,
    mut new: Value,
) -> Result<Value, ApiError> {
    let Some(obj) = new.as_object_mut() else {
        return Err(ApiError::bad_request(format!("the {kind} must be a JSON object")));
    };
    let meta = obj.entry("metadata").or_insert_with(|| json!({}));
    if meta.is_null() {
        *meta = json!({});
    }
    let Some(meta) = meta.as_object_mut() else {
        return Err(ApiError::bad_request("metadata must be a JSON object"));
    };
    match meta.get("resourceVersion") {
        None | Some(Value::Null) => {}
        Some(Value::String(rv)) if rv.is_empty() || rv == meta_str(current, "resourceVersion") => {}
        Some(Value::String(_)) => return Err(ApiError::modified(resource, name)),
        Some(_) => return Err(ApiError::bad_request("metadata.resourceVersion must be a string")),
    }
    if let Some(uid) = meta.get("uid").and_then(Value::as_str) {
        let current_uid = meta_str(current, "uid");
        if !uid.is_empty() && uid != current_uid {
            return Err(ApiError::conflict(
                resource,
                name,
                &format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {current_uid}"),
            ));
        }
    }
    if let Some(n) = meta.get("name").and_then(Value::as_str)
        && !n.is_empty()
        && n != name
    {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({n}) does not match the name on the URL ({name})"
        )));
    }
    for field in ["name", "namespace", "uid", "resourceVersion", "creationTimestamp"] {
        match meta_field(current, field) {
            Some(v) => meta.insert(field.to_owned(), v.clone()),
            None => meta.remove(field),
        };
    }
    for field in ["labels", "annotations"] {
        match meta.get(field) {
            None => {}
            Some(Value::Null) => {
                meta.remove(field);
            }
            Some(Value::Object(m)) => {
                if let Some((k, v)) = m.iter().find(|(_, v)| !v.is_string()) {
                    return Err(ApiError::bad_request(format!(
                        "json: cannot unmarshal {} into Go struct field ObjectMeta.metadata.{field} of type string \
                         (key {k:?})",
                        json_type(v)
                    )));
                }
                if m.is_empty() {
                    meta.remove(field);
                }
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "json: cannot unmarshal {} into Go struct field ObjectMeta.metadata.{field} of type map[string]string",
                    json_type(other)
                )));
            }
        }
    }
    obj.insert("kind".into(), Value::String(kind.into()));
    obj.insert("apiVersion".into(), Value::String(api_version.into()));
    Ok(new)
}

fn meta_field<'a>(obj: &'a Value, field: &str) -> Option<&'a Value> {
    meta(obj).get(field)
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn meta_causes(obj: &Value) -> Vec<Cause> {
    let mut causes: Vec<Cause> = Vec::new();
    if let Some(Value::Object(labels)) = meta_field(obj, "labels") {
        causes.extend(validate::labels(labels));
    }
    if let Some(Value::Object(annotations)) = meta_field(obj, "annotations") {
        causes.extend(validate::annotations(annotations));
    }
    causes
}

fn validate_meta(kind: &str, name: &str, obj: &Value) -> Result<(), ApiError> {
    let causes = meta_causes(obj);
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(kind, name, causes))
    }
}

impl Store {
    pub fn new(history_limit: usize) -> Store {
        Store {
            rv: 1000,
            floor: 0,
            nodes: BTreeMap::new(),
            events: Vec::new(),
            event_at: HashMap::new(),
            runtime_classes: BTreeMap::new(),
            resource_slices: BTreeMap::new(),
            slices_by_node: HashMap::new(),
            resource_claims: BTreeMap::new(),
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            watchers: Watchers::default(),
        }
    }

    pub fn rv(&self) -> u64 {
        self.rv
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, change: Change) {
        // Each kind of line is serialized once and shared by every watch that gets it.
        let mut lines: [Option<Bytes>; 3] = [None, None, None];
        let mut send = |w: &Watcher| match event_for(&w.filter, &change) {
            Some((kind, obj)) => {
                let slot = match kind {
                    "ADDED" => 0,
                    "MODIFIED" => 1,
                    _ => 2,
                };
                let line = lines[slot].get_or_insert_with(|| watch_line(kind, obj));
                w.tx.send(line.clone()).is_ok()
            }
            None => !w.tx.is_closed(),
        };
        let watchers = &mut self.watchers;
        if let Some(list) = watchers.by_name.get_mut(meta_str(&change.obj, "name")) {
            list.retain(&mut send);
            if list.is_empty() {
                watchers.by_name.remove(meta_str(&change.obj, "name"));
            }
        }
        watchers.others.retain(send);
        self.history.push_back(change);
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.floor = self.floor.max(dropped.rv);
            }
        }
    }

    // ----- nodes -----

    pub fn node(&self, name: &str) -> Option<&Value> {
        self.nodes.get(name)
    }

    /// Creates a node from a full object (`metadata.name` required); fills uid, RV, timestamp.
    pub fn create_node(&mut self, mut obj: Value) -> Result<Value, ApiError> {
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if name.is_empty() {
            return Err(ApiError::invalid(
                "Node",
                "",
                vec![Cause::required("metadata.name", "name is required")],
            ));
        }
        if self.nodes.contains_key(&name) {
            return Err(ApiError::already_exists("nodes", &name));
        }
        let template = fresh_metadata(&mut obj, &name);
        let mut obj = prepare_update("nodes", "Node", "v1", &name, &template, obj)?;
        validate_meta("Node", &name, &obj)?;
        let rv = self.next_rv();
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        if obj.get("spec").is_none() {
            obj["spec"] = json!({});
        }
        if obj.get("status").is_none() {
            obj["status"] = json!({});
        }
        self.nodes.insert(name, obj.clone());
        self.record(Change {
            rv,
            old: None,
            obj: obj.clone(),
            deleted: false,
        });
        Ok(obj)
    }

    /// Replaces a node with `new` (as after a patch or PUT): preconditions, validation, and a
    /// new RV plus a MODIFIED event only when something changed.
    pub fn update_node(&mut self, name: &str, new: Value) -> Result<Value, ApiError> {
        let current = self.nodes.get(name).ok_or_else(|| ApiError::not_found("nodes", name))?;
        let new = prepare_update("nodes", "Node", "v1", name, current, new)?;
        validate_meta("Node", name, &new)?;
        if new == *current {
            return Ok(new);
        }
        let old = current.clone();
        let rv = self.next_rv();
        let mut new = new;
        new["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.nodes.insert(name.to_owned(), new.clone());
        self.record(Change {
            rv,
            old: Some(old),
            obj: new.clone(),
            deleted: false,
        });
        Ok(new)
    }

    pub fn delete_node(&mut self, name: &str) -> Option<Value> {
        let old = self.nodes.remove(name)?;
        let rv = self.next_rv();
        let mut obj = old.clone();
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.record(Change {
            rv,
            old: Some(old),
            obj: obj.clone(),
            deleted: true,
        });
        Some(obj)
    }

    /// The nodes `filter` selects, in name order; one lookup when it names the node.
    fn matching_nodes<'a>(&'a self, filter: &'a Filter) -> impl Iterator<Item = &'a Value> + 'a {
        let (one, all) = match filter.fields.required("metadata.name") {
            Some(name) => (self.nodes.get(name), None),
            None => (None, Some(self.nodes.values())),
        };
        one.into_iter()
            .chain(all.into_iter().flatten())
            .filter(|n| filter.matches(n))
    }

    pub fn node_list(&self, filter: &Filter) -> Value {
        let items: Vec<Value> = self.matching_nodes(filter).map(list_item).collect();
        json!({
            "kind": "NodeList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": self.rv.to_string()},
            "items": items,
        })
    }

    // ----- watches -----

    /// Opens a watch. `Err` is the 410 `Expired` status for an RV older than the history.
    pub fn watch(
        &mut self,
        filter: Filter,
        from: WatchFrom,
        bookmarks: bool,
        send_initial_events: bool,
    ) -> Result<mpsc::UnboundedReceiver<Bytes>, ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let initial = |tx: &mpsc::UnboundedSender<Bytes>| {
            for node in self.matching_nodes(&filter) {
                let _ = tx.send(watch_line("ADDED", node));
            }
        };
        match from {
            WatchFrom::Now => initial(&tx),
            WatchFrom::After(rv) if rv < self.floor => return Err(ApiError::expired(rv, self.rv)),
            WatchFrom::After(_) if send_initial_events => initial(&tx),
            WatchFrom::After(rv) => {
                for change in self.history.iter().filter(|c| c.rv > rv) {
                    if let Some((kind, obj)) = event_for(&filter, change) {
                        let _ = tx.send(watch_line(kind, obj));
                    }
                }
            }
        }
        if send_initial_events && bookmarks {
            let _ = tx.send(bookmark_line(self.rv, true));
        }
        self.watchers.add(Watcher { tx, filter, bookmarks });
        Ok(rx)
    }

    pub fn send_bookmarks(&mut self) {
        let line = bookmark_line(self.rv, false);
        self.watchers
            .retain_all(|w| !w.bookmarks || w.tx.send(line.clone()).is_ok());
    }

    /// Ends every open watch stream (cleanly: the response body ends).
    pub fn drop_watches(&mut self) {
        self.watchers.clear();
    }

    pub fn open_watches(&mut self) -> usize {
        self.watchers.retain_all(|w| !w.tx.is_closed());
        self.watchers.len()
    }

    /// Forgets the history: every RV below the current one is expired for watches.
    pub fn compact(&mut self) {
        self.history.clear();
        self.floor = self.rv;
    }

    /// A restarted API server's watch cache: the resourceVersion moves on by one (kube-apiserver
    /// writes its identity Lease at start, so etcd's revision always moves) and the history
    /// starts there, so every RV a client holds is expired.
    pub fn restarted(&mut self) {
        self.next_rv();
        self.compact();
    }

    // ----- events -----

    pub fn events(&self) -> &[Value] {
        &self.events
    }

    fn event_index(&self, ns: &str, name: &str) -> Option<usize> {
        self.event_at.get(ns)?.get(name).copied()
    }

    pub fn event(&self, ns: &str, name: &str) -> Option<&Value> {
        self.event_index(ns, name).map(|i| &self.events[i])
    }

    pub fn create_event(&mut self, ns: &str, mut ev: Value) -> Result<Value, ApiError> {
        let Some(obj) = ev.as_object_mut() else {
            return Err(ApiError::bad_request("the Event must be a JSON object"));
        };
        let meta = obj.entry("metadata").or_insert_with(|| json!({}));
        let Some(meta) = meta.as_object_mut() else {
            return Err(ApiError::bad_request("metadata must be a JSON object"));
        };
        match meta.get("namespace").and_then(Value::as_str) {
            Some(n) if !n.is_empty() && n != ns => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            _ => {
                meta.insert("namespace".into(), Value::String(ns.to_owned()));
            }
        }
        let name = meta.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
        let generate = meta
            .get("generateName")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let name = if name.is_empty() && !generate.is_empty() {
            loop {
                let candidate = format!("{generate}{}", generated_suffix());
                if self.event_index(ns, &candidate).is_none() {
                    break candidate;
                }
            }
        } else {
            name
        };
        meta.insert("name".into(), Value::String(name.clone()));
        meta.insert("uid".into(), Value::String(new_uid()));
        meta.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
        meta.remove("resourceVersion");
        obj.insert("kind".into(), Value::String("Event".into()));
        obj.insert("apiVersion".into(), Value::String("v1".into()));
        let causes = validate::event(&ev);
        if !causes.is_empty() {
            return Err(ApiError::invalid("Event", &name, causes));
        }
        validate_meta("Event", &name, &ev)?;
        if self.event_index(ns, &name).is_some() {
            return Err(ApiError::already_exists("events", &name));
        }
        let rv = self.next_rv();
        ev["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.event_at
            .entry(ns.to_owned())
            .or_default()
            .insert(name, self.events.len());
        self.events.push(ev.clone());
        Ok(ev)
    }

    /// The RuntimeClasses, by name.
    pub fn runtime_classes(&self) -> &BTreeMap<String, Value> {
        &self.runtime_classes
    }

    /// Creates a RuntimeClass as the API server does: `metadata.name` and `handler` required
    /// (a DNS label), a name that exists is 409 AlreadyExists.
    pub fn create_runtime_class(&mut self, mut rc: Value) -> Result<Value, ApiError> {
        let Some(obj) = rc.as_object_mut() else {
            return Err(ApiError::bad_request("the RuntimeClass must be a JSON object"));
        };
        let name = obj
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let handler = obj
            .get("handler")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let mut causes = Vec::new();
        if name.is_empty() {
            causes.push(crate::status::Cause::required(
                "metadata.name",
                "name or generateName is required",
            ));
        }
        if handler.is_empty() {
            causes.push(crate::status::Cause::required("handler", "Required value"));
        } else if handler.len() > 63
            || !handler
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            causes.push(crate::status::Cause::invalid(
                "handler",
                &handler,
                "a lowercase RFC 1123 label",
            ));
        }
        if !causes.is_empty() {
            return Err(ApiError::invalid("RuntimeClass", &name, causes));
        }
        if self.runtime_classes.contains_key(&name) {
            return Err(ApiError::already_exists("runtimeclasses.node.k8s.io", &name));
        }
        obj.insert("kind".into(), Value::String("RuntimeClass".into()));
        obj.insert("apiVersion".into(), Value::String("node.k8s.io/v1".into()));
        let rv = self.next_rv();
        rc["metadata"]["uid"] = Value::String(new_uid());
        rc["metadata"]["creationTimestamp"] = Value::String(now_rfc3339());
        rc["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.runtime_classes.insert(name, rc.clone());
        Ok(rc)
    }

    pub fn update_event(&mut self, ns: &str, name: &str, new: Value) -> Result<Value, ApiError> {
        let i = self
            .event_index(ns, name)
            .ok_or_else(|| ApiError::not_found("events", name))?;
        let new = prepare_update("events", "Event", "v1", name, &self.events[i], new)?;
        validate_meta("Event", name, &new)?;
        if new == self.events[i] {
            return Ok(new);
        }
        let rv = self.next_rv();
        let mut new = new;
        new["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.events[i] = new.clone();
        Ok(new)
    }

    pub fn event_list(&self, ns: Option<&str>, filter: &Filter) -> Value {
        let items: Vec<Value> = self
            .events
            .iter()
            .filter(|e| ns.is_none_or(|ns| meta_str(e, "namespace") == ns) && filter.matches(e))
            .map(list_item)
            .collect();
        json!({
            "kind": "EventList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": self.rv.to_string()},
            "items": items,
        })
    }

    // ----- ResourceSlices (resource.k8s.io/v1) -----

    pub fn resource_slices(&self) -> &BTreeMap<String, Value> {
        &self.resource_slices
    }

    pub fn resource_slice(&self, name: &str) -> Option<&Value> {
        self.resource_slices.get(name)
    }

    /// Creates a ResourceSlice (after [`dra::decode_slice`]): name or `generateName`, server
    /// fields, `metadata.generation` 1, validation (422), then 409 if the name is taken.
    pub fn create_resource_slice(&mut self, mut obj: Value) -> Result<Value, ApiError> {
        let name = meta_str(&obj, "name").to_owned();
        let generate = meta_str(&obj, "generateName").to_owned();
        let name = if name.is_empty() && !generate.is_empty() {
            loop {
                let candidate = format!("{generate}{}", generated_suffix());
                if !self.resource_slices.contains_key(&candidate) {
                    break candidate;
                }
            }
        } else {
            name
        };
        let template = fresh_metadata(&mut obj, &name);
        if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            m.insert("name".into(), Value::String(name.clone()));
        }
        let mut obj = prepare_update(dra::SLICES, "ResourceSlice", dra::API_VERSION, &name, &template, obj)?;
        obj["metadata"]["generation"] = json!(1);
        let mut causes = dra::validate_slice(&obj, None);
        causes.extend(meta_causes(&obj));
        if !causes.is_empty() {
            return Err(ApiError::invalid_in(dra::GROUP, "ResourceSlice", &name, causes));
        }
        if self.resource_slices.contains_key(&name) {
            return Err(ApiError::already_exists(dra::SLICES, &name));
        }
        let rv = self.next_rv();
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.index_slice(&name, &obj, true);
        self.resource_slices.insert(name, obj.clone());
        Ok(obj)
    }

    /// Replaces a ResourceSlice (PUT, or the result of a patch): resourceVersion/uid
    /// preconditions (409), validation with the immutable fields (422); `metadata.generation`
    /// goes up when the spec changes; a write that changes nothing keeps the resourceVersion.
    pub fn update_resource_slice(&mut self, name: &str, new: Value) -> Result<Value, ApiError> {
        let current = self
            .resource_slices
            .get(name)
            .ok_or_else(|| ApiError::not_found(dra::SLICES, name))?;
        let mut new = prepare_update(dra::SLICES, "ResourceSlice", dra::API_VERSION, name, current, new)?;
        let generation = current
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        let spec_changed = new.get("spec") != current.get("spec");
        new["metadata"]["generation"] = json!(if spec_changed { generation + 1 } else { generation });
        let mut causes = dra::validate_slice(&new, Some(current));
        causes.extend(meta_causes(&new));
        if !causes.is_empty() {
            return Err(ApiError::invalid_in(dra::GROUP, "ResourceSlice", name, causes));
        }
        if new == *current {
            return Ok(new);
        }
        let rv = self.next_rv();
        new["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        // `spec.nodeName` is immutable (validated above); re-indexed all the same.
        if let Some(old) = self.resource_slices.insert(name.to_owned(), new.clone()) {
            self.index_slice(name, &old, false);
        }
        self.index_slice(name, &new, true);
        Ok(new)
    }

    /// Deletes one ResourceSlice; returns it as it was.
    pub fn delete_resource_slice(&mut self, name: &str) -> Option<Value> {
        let old = self.resource_slices.remove(name)?;
        self.index_slice(name, &old, false);
        self.next_rv();
        Some(old)
    }

    /// Deletes every ResourceSlice `matches` accepts and returns them, in name order. Each
    /// deletion is a write of its own (one resourceVersion each), as upstream.
    pub fn delete_resource_slices_where(&mut self, matches: impl Fn(&Value) -> bool) -> Vec<Value> {
        let names: Vec<String> = self
            .resource_slices
            .iter()
            .filter(|(_, s)| matches(s))
            .map(|(n, _)| n.clone())
            .collect();
        names.iter().filter_map(|n| self.delete_resource_slice(n)).collect()
    }

    /// deletecollection: deletes the slices `filter` selects (through the index, as a list).
    pub fn delete_matching_slices(&mut self, filter: &Filter) -> Vec<Value> {
        let names: Vec<String> = self
            .matching_slices(filter)
            .filter_map(|s| s.pointer("/metadata/name").and_then(Value::as_str))
            .map(str::to_owned)
            .collect();
        names.iter().filter_map(|n| self.delete_resource_slice(n)).collect()
    }

    pub fn resource_slice_list(&self, filter: &Filter) -> Value {
        let items: Vec<Value> = self.matching_slices(filter).cloned().collect();
        self.dra_list("ResourceSliceList", items)
    }

    /// Adds (`present`) or removes a slice in the `spec.nodeName` index.
    fn index_slice(&mut self, name: &str, slice: &Value, present: bool) {
        let Some(node) = slice.pointer("/spec/nodeName").and_then(Value::as_str) else {
            return;
        };
        if present {
            self.slices_by_node
                .entry(node.to_owned())
                .or_default()
                .insert(name.to_owned());
        } else if let Some(names) = self.slices_by_node.get_mut(node) {
            names.remove(name);
            if names.is_empty() {
                self.slices_by_node.remove(node);
            }
        }
    }

    /// The ResourceSlices `filter` selects, in name order; through the `spec.nodeName` index
    /// when the selector names the node.
    pub fn matching_slices<'a>(&'a self, filter: &'a Filter) -> impl Iterator<Item = &'a Value> + 'a {
        // `spec.nodeName=` (empty) selects the slices without one, which the index leaves out.
        let (own, all) = match filter.fields.required("spec.nodeName").filter(|n| !n.is_empty()) {
            Some(node) => (self.slices_by_node.get(node), None),
            None => (None, Some(self.resource_slices.values())),
        };
        let own = own
            .into_iter()
            .flatten()
            .filter_map(|name| self.resource_slices.get(name));
        own.chain(all.into_iter().flatten()).filter(|s| filter.matches(s))
    }

    /// A `resource.k8s.io/v1` list of `items` (without their kind and apiVersion, as upstream).
    pub fn dra_list(&self, kind: &str, items: Vec<Value>) -> Value {
        let items: Vec<Value> = items.iter().map(list_item).collect();
        json!({
            "kind": kind,
            "apiVersion": dra::API_VERSION,
            "metadata": {"resourceVersion": self.rv.to_string()},
            "items": items,
        })
    }

    // ----- ResourceClaims (resource.k8s.io/v1) -----

    pub fn resource_claim(&self, ns: &str, name: &str) -> Option<&Value> {
        self.resource_claims.get(&(ns.to_owned(), name.to_owned()))
    }

    /// Stores a claim as given (the scheduler's and the controller's writes, done by a test):
    /// `metadata.namespace` and `name` must be set (checked by the caller); a uid is added if
    /// absent; resourceVersion and creationTimestamp are the server's. Replaces a claim of the
    /// same name.
    pub fn put_resource_claim(&mut self, mut claim: Value) -> Value {
        let ns = meta_str(&claim, "namespace").to_owned();
        let name = meta_str(&claim, "name").to_owned();
        let rv = self.next_rv();
        if let Some(obj) = claim.as_object_mut() {
            obj.insert("kind".into(), Value::String("ResourceClaim".into()));
            obj.insert("apiVersion".into(), Value::String(dra::API_VERSION.into()));
        }
        let meta = &mut claim["metadata"];
        if meta.get("uid").and_then(Value::as_str).is_none_or(str::is_empty) {
            meta["uid"] = Value::String(new_uid());
        }
        meta["resourceVersion"] = Value::String(rv.to_string());
        meta["creationTimestamp"] = Value::String(now_rfc3339());
        self.resource_claims.insert((ns, name), claim.clone());
        claim
    }

    pub fn delete_resource_claim(&mut self, ns: &str, name: &str) -> Option<Value> {
        let old = self.resource_claims.remove(&(ns.to_owned(), name.to_owned()))?;
        self.next_rv();
        Some(old)
    }

    pub fn resource_claim_list(&self, ns: Option<&str>, filter: &Filter) -> Value {
        let items: Vec<Value> = self
            .resource_claims
            .iter()
            .filter(|((n, _), c)| ns.is_none_or(|ns| ns == n) && filter.matches(c))
            .map(|(_, c)| c.clone())
            .collect();
        self.dra_list("ResourceClaimList", items)
    }
}
