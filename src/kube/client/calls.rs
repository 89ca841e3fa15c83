//! The API calls the agent makes on its own Node (get, watch, merge-patch labels and
//! annotations, post Events and patch their counts, create RuntimeClasses), and the bodies
//! they send.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use reqwest::Method;
use serde::Serialize;

use super::{KubeClient, Limit};
use crate::kube::error::{ApiFailure, ApiStatus, HttpFailure, KubeError, body_failure};
use crate::kube::limit::{MAX_API_BODY, drain_body, read_body};
use crate::kube::node::Node;
use crate::kube::time::format_rfc3339;
use crate::kube::watch::WatchStream;
use crate::names::truncate;

/// `source.component` of the Events the agent posts, and its User-Agent.
pub const COMPONENT: &str = "gpu-node-agent";
/// Namespace of Node Events (where the kubelet puts them too).
pub const EVENT_NAMESPACE: &str = "default";
/// A watch connection that sends nothing for its `timeoutSeconds` plus this is presumed dead.
pub const WATCH_IDLE_MARGIN: Duration = Duration::from_secs(30);
/// Longest Event message sent; longer ones are cut (the API limits them).
pub const MAX_EVENT_MESSAGE: usize = 1024;

/// Severity of an Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EventType {
    /// Things going as planned.
    Normal,
    /// Something an operator should look at.
    Warning,
}

/// An Event about the agent's Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEvent {
    /// The Node's name (also `source.host`).
    pub node_name: String,
    /// The Node's uid, when known (empty: omitted).
    pub node_uid: String,
    /// Normal or Warning.
    pub event_type: EventType,
    /// UpperCamelCase reason, e.g. `MigConfigApplied`.
    pub reason: String,
    /// Human-readable message (cut at [`MAX_EVENT_MESSAGE`] bytes).
    pub message: String,
}

impl KubeClient {
    /// GETs `path` (a read: `verb` is `get` or `list`) and returns its body, read bounded by
    /// [`MAX_API_BODY`].
    async fn read(&self, verb: &'static str, path: &str) -> Result<Vec<u8>, ApiFailure> {
        let limit = Limit::Total(self.inner.request_timeout);
        let mut response = self.send(verb, Method::GET, path, None, limit).await?;
        read_body(&mut response, MAX_API_BODY).await.map_err(body_failure)
    }

    /// Reads the Node. `from_cache` asks for `resourceVersion=0`: served from the API server's
    /// watch cache, cheap, possibly a moment stale.
    pub async fn get_node(&self, name: &str, from_cache: bool) -> Result<Node, KubeError> {
        let mut path = format!("/api/v1/nodes/{}", encode(name));
        if from_cache {
            path.push_str("?resourceVersion=0");
        }
        let fail = |failure| KubeError::GetNode {
            name: name.to_string(),
            path: path.clone(),
            failure,
        };
        let body = self.read("get", &path).await.map_err(fail)?;
        Node::from_json(&body).map_err(|e| fail(ApiFailure::Decode(e)))
    }

    /// Lists the Node by name (`fieldSelector=metadata.name=<name>`, as the kubelet's own Node
    /// informer does): the Node and the list's resourceVersion, the one to watch from. Unlike
    /// the Node's own resourceVersion, the list's is never older than the API server's watch
    /// cache, so watching from it does not get 410 after an API server restart when the Node
    /// has not changed since. `from_cache` asks for `resourceVersion=0`. No such Node: the 404 a
    /// GET would have given.
    pub async fn list_node(&self, name: &str, from_cache: bool) -> Result<(Node, String), KubeError> {
        let mut path = format!("/api/v1/nodes?fieldSelector=metadata.name%3D{}", encode(name));
        if from_cache {
            path.push_str("&resourceVersion=0");
        }
        let fail = |failure| KubeError::ListNode {
            name: name.to_string(),
            path: path.clone(),
            failure,
        };
        let body = self.read("list", &path).await.map_err(fail)?;
        let (nodes, rv) = Node::list_from_json(&body).map_err(|e| fail(ApiFailure::Decode(e)))?;
        match nodes.into_iter().find(|n| n.name == name) {
            Some(node) => Ok((node, rv)),
            None => Err(fail(ApiFailure::Http(Box::new(HttpFailure {
                code: 404,
                status: Some(ApiStatus {
                    code: 404,
                    reason: "NotFound".into(),
                    message: format!(
                        "nodes \"{name}\" not found (the list by name came back empty{})",
                        if from_cache {
                            ", from the API server's cache"
                        } else {
                            ""
                        }
                    ),
                    retry_after_seconds: None,
                }),
                retry_after: None,
                body: String::new(),
            })))),
        }
    }

    /// Watches the Node from `resource_version` (empty: from now, starting with its current
    /// state). The server ends the stream after `timeout` (`timeoutSeconds`, at least 1 s);
    /// a connection silent for longer than that plus [`WATCH_IDLE_MARGIN`] ends it with an
    /// error. Bookmarks are requested.
    pub async fn watch_node(
        &self,
        name: &str,
        resource_version: &str,
        timeout: Duration,
    ) -> Result<WatchStream, KubeError> {
        let secs = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
        let secs = secs.max(1);
        let mut path = format!("/api/v1/nodes?watch=1&fieldSelector=metadata.name%3D{}", encode(name));
        if !resource_version.is_empty() {
            path.push_str(&format!("&resourceVersion={}", encode(resource_version)));
        }
        path.push_str(&format!("&allowWatchBookmarks=true&timeoutSeconds={secs}"));
        let limit = Limit::Headers(self.inner.request_timeout);
        let response = self
            .send("watch", Method::GET, &path, None, limit)
            .await
            .map_err(|failure| KubeError::WatchNode {
                name: name.to_string(),
                path: path.clone(),
                failure,
            })?;
        let idle = Duration::from_secs(secs) + WATCH_IDLE_MARGIN;
        Ok(WatchStream::from_response(response, idle, name.to_string(), path))
    }

    /// Sets (`Some`) or removes (`None`) labels and annotations with a JSON merge patch, and
    /// returns the updated Node. Keys not named are left alone; there is no resourceVersion
    /// precondition (the agent owns the keys it writes). Empty maps are left out of the patch.
    pub async fn patch_node_metadata(
        &self,
        name: &str,
        labels: &BTreeMap<String, Option<String>>,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> Result<Node, KubeError> {
        let path = format!("/api/v1/nodes/{}", encode(name));
        let fail = |failure| KubeError::PatchNode {
            name: name.to_string(),
            path: path.clone(),
            failure,
        };
        let body = metadata_patch(labels, annotations);
        let limit = Limit::Total(self.inner.request_timeout);
        let mut response = self
            .send(
                "patch",
                Method::PATCH,
                &path,
                Some(("application/merge-patch+json", body)),
                limit,
            )
            .await
            .map_err(fail)?;
        let body = read_body(&mut response, MAX_API_BODY)
            .await
            .map_err(|e| fail(body_failure(e)))?;
        Node::from_json(&body).map_err(|e| fail(ApiFailure::Decode(e)))
    }

    /// Posts an Event about the Node in namespace `default`.
    pub async fn create_event(&self, event: &NodeEvent) -> Result<(), KubeError> {
        let path = format!("/api/v1/namespaces/{EVENT_NAMESPACE}/events");
        let now = SystemTime::now();
        let body = event_body(event, None, 1, now, now).to_string().into_bytes();
        let limit = Limit::Total(self.inner.request_timeout);
        let response = self
            .send("create", Method::POST, &path, Some(("application/json", body)), limit)
            .await
            .map_err(|failure| KubeError::CreateEvent {
                name: event.node_name.clone(),
                reason: event.reason.clone(),
                path: path.clone(),
                failure,
            })?;
        // Drain the body (unused, and bounded) so the connection can be reused.
        drain_body(response, MAX_API_BODY).await;
        Ok(())
    }

    /// Posts an Event about the Node that stands for `count` occurrences between `first` and
    /// `last`, and returns the name the server gave it (from `generateName`), so that later
    /// occurrences can be added to it with [`KubeClient::patch_event`].
    pub async fn create_event_counted(
        &self,
        event: &NodeEvent,
        name: &str,
        count: u64,
        first: SystemTime,
        last: SystemTime,
    ) -> Result<String, KubeError> {
        let path = format!("/api/v1/namespaces/{EVENT_NAMESPACE}/events");
        let fail = |failure| KubeError::CreateEvent {
            name: event.node_name.clone(),
            reason: event.reason.clone(),
            path: path.clone(),
            failure,
        };
        let body = event_body(event, Some(name), count, first, last)
            .to_string()
            .into_bytes();
        let limit = Limit::Total(self.inner.request_timeout);
        let mut response = self
            .send("create", Method::POST, &path, Some(("application/json", body)), limit)
            .await
            .map_err(fail)?;
        let body = read_body(&mut response, MAX_API_BODY)
            .await
            .map_err(|e| fail(body_failure(e)))?;
        let created: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| fail(ApiFailure::Decode(format!("the created Event: {e}"))))?;
        match created["metadata"]["name"].as_str() {
            Some(name) if !name.is_empty() => Ok(name.to_owned()),
            _ => Err(fail(ApiFailure::Decode(
                "the created Event has no metadata.name".into(),
            ))),
        }
    }

    /// Adds occurrences to an Event created before, as client-go's event correlator does: a
    /// merge patch of its `count` (the new total), `message` (the latest) and `lastTimestamp`.
    /// A 404 means the Event is gone (the API server deletes Events after its `--event-ttl`,
    /// an hour by default).
    pub async fn patch_event(
        &self,
        event: &NodeEvent,
        name: &str,
        count: u64,
        last: SystemTime,
    ) -> Result<(), KubeError> {
        let path = format!("/api/v1/namespaces/{EVENT_NAMESPACE}/events/{}", encode(name));
        let body = serde_json::json!({
            "count": count_field(count),
            "lastTimestamp": format_rfc3339(last),
            "message": truncate(&event.message, MAX_EVENT_MESSAGE),
        })
        .to_string()
        .into_bytes();
        let limit = Limit::Total(self.inner.request_timeout);
        let response = self
            .send(
                "patch",
                Method::PATCH,
                &path,
                Some(("application/merge-patch+json", body)),
                limit,
            )
            .await
            .map_err(|failure| KubeError::PatchEvent {
                name: event.node_name.clone(),
                event: name.to_owned(),
                path: path.clone(),
                failure,
            })?;
        drain_body(response, MAX_API_BODY).await;
        Ok(())
    }

    /// Creates the RuntimeClass `name` with the handler `name` (`node.k8s.io/v1`). `Ok(false)`:
    /// it exists already (409 AlreadyExists), whoever made it; it is not changed.
    pub async fn create_runtime_class(&self, name: &str) -> Result<bool, KubeError> {
        let path = "/apis/node.k8s.io/v1/runtimeclasses".to_owned();
        let body = serde_json::json!({
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": COMPONENT}},
            "handler": name,
        })
        .to_string()
        .into_bytes();
        let limit = Limit::Total(self.inner.request_timeout);
        match self
            .send("create", Method::POST, &path, Some(("application/json", body)), limit)
            .await
        {
            Ok(response) => {
                drain_body(response, MAX_API_BODY).await;
                Ok(true)
            }
            Err(failure) if failure.http().is_some_and(|h| h.code == 409) => Ok(false),
            Err(failure) => Err(KubeError::CreateRuntimeClass {
                name: name.to_owned(),
                path,
                failure,
            }),
        }
    }
}

/// The merge patch body: `{"metadata":{"labels":{k: v|null},"annotations":{...}}}`.
fn metadata_patch(
    labels: &BTreeMap<String, Option<String>>,
    annotations: &BTreeMap<String, Option<String>>,
) -> Vec<u8> {
    let mut metadata = serde_json::Map::new();
    if !labels.is_empty() {
        metadata.insert("labels".into(), serde_json::to_value(labels).unwrap_or_default());
    }
    if !annotations.is_empty() {
        metadata.insert(
            "annotations".into(),
            serde_json::to_value(annotations).unwrap_or_default(),
        );
    }
    serde_json::json!({ "metadata": metadata }).to_string().into_bytes()
}

/// `count` as the Event's `count` field, an int32: capped rather than wrapped.
fn count_field(count: u64) -> u64 {
    count.min(i32::MAX as u64)
}

/// The core/v1 Event for a NodeEvent that happened `count` times from `first` to `last`.
fn event_body(
    event: &NodeEvent,
    name: Option<&str>,
    count: u64,
    first: SystemTime,
    last: SystemTime,
) -> serde_json::Value {
    let mut involved = serde_json::json!({ "apiVersion": "v1", "kind": "Node", "name": event.node_name });
    if !event.node_uid.is_empty() {
        involved["uid"] = event.node_uid.clone().into();
    }
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": match name {
            Some(name) => serde_json::json!({ "name": name, "namespace": EVENT_NAMESPACE }),
            None => serde_json::json!({ "generateName": format!("{}.", event.node_name), "namespace": EVENT_NAMESPACE }),
        },
        "involvedObject": involved,
        "reason": event.reason,
        "message": truncate(&event.message, MAX_EVENT_MESSAGE),
        "type": event.event_type,
        "source": { "component": COMPONENT, "host": event.node_name },
        "firstTimestamp": format_rfc3339(first),
        "lastTimestamp": format_rfc3339(last),
        "count": count_field(count),
        "reportingComponent": COMPONENT,
        "reportingInstance": event.node_name,
    })
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
pub(super) fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_timestamps_are_rfc3339() {
        let event = NodeEvent {
            node_name: "n".into(),
            node_uid: String::new(),
            event_type: EventType::Normal,
            reason: "R".into(),
            message: "é".repeat(600),
        };
        let first = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let body = event_body(&event, None, 1, first, first + Duration::from_secs(61));
        assert_eq!(body["firstTimestamp"], "2023-11-14T22:13:20Z");
        assert_eq!(body["lastTimestamp"], "2023-11-14T22:14:21Z");
        assert_eq!(body["count"], 1);
        assert_eq!(event_body(&event, None, u64::MAX, first, first)["count"], i32::MAX);
        assert_eq!(
            event_body(&event, Some("n.17"), 1, first, first)["metadata"]["name"],
            "n.17"
        );
        assert!(body["involvedObject"].get("uid").is_none());
        assert_eq!(body["message"].as_str().map(str::len), Some(1024));
    }

    #[test]
    fn encodes_query_values() {
        assert_eq!(encode("gpu-1.example_x~"), "gpu-1.example_x~");
        assert_eq!(encode("a b/c=d&e"), "a%20b%2Fc%3Dd%26e");
    }
}
