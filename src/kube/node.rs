//! The slice of a core/v1 Node the agent reads: identity, resourceVersion, labels and
//! annotations. Everything else in the object (status, images, ...) is skipped while parsing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::{RawStatus, RawStatusDetails};

/// A Node's metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Node {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.resourceVersion`: opaque, compared only for equality.
    pub resource_version: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
}

impl Node {
    /// Parses a Node from JSON.
    pub fn from_json(body: &[u8]) -> Result<Node, String> {
        let raw: RawObject = serde_json::from_slice(body).map_err(|e| format!("not a Node object: {e}"))?;
        raw.into_node()
    }

    /// Parses a `NodeList`: its items and the list's own `metadata.resourceVersion` (the
    /// store's revision when it was read, which a watch can start from even when no item
    /// changed since the API server's watch cache began; an item's own resourceVersion can be
    /// older than that cache and get a 410).
    pub fn list_from_json(body: &[u8]) -> Result<(Vec<Node>, String), String> {
        #[derive(Deserialize)]
        struct RawList {
            #[serde(default)]
            metadata: Option<RawMeta>,
            #[serde(default)]
            items: Option<Vec<RawObject>>,
        }
        let raw: RawList = serde_json::from_slice(body).map_err(|e| format!("not a NodeList: {e}"))?;
        let rv = raw
            .metadata
            .and_then(|m| m.resource_version)
            .filter(|rv| !rv.is_empty())
            .ok_or("a NodeList without metadata.resourceVersion")?;
        let nodes = raw
            .items
            .unwrap_or_default()
            .into_iter()
            .map(RawObject::into_node)
            .collect::<Result<Vec<Node>, String>>()?;
        Ok((nodes, rv))
    }

    /// Same name, uid, labels and annotations: what the agent reacts to (the resourceVersion
    /// changes with every status update and is ignored).
    pub fn same_metadata(&self, other: &Node) -> bool {
        self.name == other.name
            && self.uid == other.uid
            && self.labels == other.labels
            && self.annotations == other.annotations
    }
}

/// Any object the API sends: a Node, a Status (watch ERROR), or a bookmark's stub. Only the
/// fields the agent reads are declared.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct RawObject {
    pub kind: Option<String>,
    pub metadata: Option<RawMeta>,
    pub code: Option<u16>,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub details: Option<RawStatusDetails>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct RawMeta {
    pub name: Option<String>,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    pub labels: Option<BTreeMap<String, String>>,
    pub annotations: Option<BTreeMap<String, String>>,
}

impl RawObject {
    pub(crate) fn into_node(self) -> Result<Node, String> {
        if let Some(kind) = self.kind.as_deref()
            && kind != "Node"
        {
            return Err(format!("expected a Node, got kind {kind:?}"));
        }
        let meta = self.metadata.ok_or("a Node without metadata")?;
        let name = meta
            .name
            .filter(|n| !n.is_empty())
            .ok_or("a Node without metadata.name")?;
        Ok(Node {
            name,
            uid: meta.uid.unwrap_or_default(),
            resource_version: meta.resource_version.unwrap_or_default(),
            labels: meta.labels.unwrap_or_default(),
            annotations: meta.annotations.unwrap_or_default(),
        })
    }

    pub(crate) fn into_status(self) -> RawStatus {
        RawStatus {
            kind: self.kind,
            code: self.code,
            reason: self.reason,
            message: self.message,
            details: self.details,
        }
    }

    pub(crate) fn resource_version(&self) -> Option<&str> {
        self.metadata.as_ref().and_then(|m| m.resource_version.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_metadata_and_skips_the_rest() {
        let node = Node::from_json(
            br#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"gpu-1","uid":"u-1","resourceVersion":"42",
                "labels":{"nvidia.com/mig.config":"all-1g.10gb"},"annotations":null,"managedFields":[{}]},
                "status":{"images":[{"names":["a"],"sizeBytes":1}],"conditions":[]}}"#,
        )
        .expect("node");
        assert_eq!(node.name, "gpu-1");
        assert_eq!(node.uid, "u-1");
        assert_eq!(node.resource_version, "42");
        assert_eq!(node.labels["nvidia.com/mig.config"], "all-1g.10gb");
        assert!(node.annotations.is_empty());
    }

    #[test]
    fn a_node_list_gives_its_items_and_its_own_resource_version() {
        let (nodes, rv) = Node::list_from_json(
            br#"{"kind":"NodeList","apiVersion":"v1","metadata":{"resourceVersion":"5000"},
                "items":[{"metadata":{"name":"gpu-1","uid":"u-1","resourceVersion":"42"}}]}"#,
        )
        .expect("list");
        assert_eq!(rv, "5000");
        assert_eq!(nodes.len(), 1);
        assert_eq!(nodes[0].resource_version, "42");
        let (nodes, _) = Node::list_from_json(br#"{"metadata":{"resourceVersion":"7"},"items":null}"#).expect("empty");
        assert!(nodes.is_empty());
        assert!(
            Node::list_from_json(br#"{"items":[]}"#).is_err(),
            "no list resourceVersion"
        );
    }

    #[test]
    fn rejects_other_objects() {
        assert!(Node::from_json(br#"{"kind":"Status","code":404}"#).is_err());
        assert!(Node::from_json(br#"{"kind":"Node","metadata":{}}"#).is_err());
        assert!(Node::from_json(b"[]").is_err());
    }

    #[test]
    fn same_metadata_ignores_resource_version() {
        let a = Node {
            name: "n".into(),
            resource_version: "1".into(),
            ..Node::default()
        };
        let mut b = Node {
            resource_version: "2".into(),
            ..a.clone()
        };
        assert!(a.same_metadata(&b));
        b.labels.insert("k".into(), "v".into());
        assert!(!a.same_metadata(&b));
    }
}
