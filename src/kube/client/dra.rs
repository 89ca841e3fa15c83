//! The `resource.k8s.io/v1` calls of the agent's DRA driver: its own node's ResourceSlices
//! (list, create, update, delete, always scoped by `spec.nodeName`, as the Node authorizer
//! demands of a node's credentials) and the ResourceClaims it prepares (get).

use reqwest::Method;
use serde_json::Value;

use super::{KubeClient, Limit};
use crate::kube::error::{ApiFailure, KubeError, body_failure};
use crate::kube::limit::{MAX_API_BODY, drain_body, read_body};

/// The API group and version of DRA objects.
pub const RESOURCE_API: &str = "/apis/resource.k8s.io/v1";

impl KubeClient {
    /// The ResourceClaim `namespace/name`.
    pub async fn get_resource_claim(&self, namespace: &str, name: &str) -> Result<Value, KubeError> {
        let path = format!(
            "{RESOURCE_API}/namespaces/{}/resourceclaims/{}",
            super::calls::encode(namespace),
            super::calls::encode(name)
        );
        let what = format!("ResourceClaim {namespace}/{name}");
        self.dra_call("get", Method::GET, path, what, None).await
    }

    /// The ResourceSlices of `node` and `driver`.
    pub async fn list_resource_slices(&self, node: &str, driver: &str) -> Result<Vec<Value>, KubeError> {
        let path = format!(
            "{RESOURCE_API}/resourceslices?fieldSelector={}",
            super::calls::encode(&format!("spec.nodeName={node},spec.driver={driver}"))
        );
        let what = format!("ResourceSlices of node {node:?}, driver {driver:?}");
        let list = self
            .dra_call("list", Method::GET, path.clone(), what.clone(), None)
            .await?;
        match list.get("items") {
            Some(Value::Array(items)) => Ok(items.clone()),
            Some(Value::Null) | None => Ok(Vec::new()),
            Some(_) => Err(KubeError::Dra {
                verb: "list",
                what,
                method: "GET",
                path,
                failure: ApiFailure::Decode("items is not an array".into()),
            }),
        }
    }

    /// Creates a ResourceSlice; returns it as stored.
    pub async fn create_resource_slice(&self, slice: &Value) -> Result<Value, KubeError> {
        let path = format!("{RESOURCE_API}/resourceslices");
        let what = format!("ResourceSlice {:?}", slice_name(slice));
        self.dra_call("create", Method::POST, path, what, Some(slice)).await
    }

    /// Replaces the ResourceSlice `slice.metadata.name` (its `resourceVersion`, when set, is the
    /// precondition); returns it as stored.
    pub async fn update_resource_slice(&self, slice: &Value) -> Result<Value, KubeError> {
        let name = slice_name(slice);
        let path = format!("{RESOURCE_API}/resourceslices/{}", super::calls::encode(name));
        let what = format!("ResourceSlice {name:?}");
        self.dra_call("update", Method::PUT, path, what, Some(slice)).await
    }

    /// Deletes the ResourceSlice `name`; one already gone is no error.
    pub async fn delete_resource_slice(&self, name: &str) -> Result<(), KubeError> {
        let path = format!("{RESOURCE_API}/resourceslices/{}", super::calls::encode(name));
        let what = format!("ResourceSlice {name:?}");
        match self.dra_call("delete", Method::DELETE, path, what, None).await {
            Err(e) if e.status_code() == Some(404) => Ok(()),
            other => other.map(drop),
        }
    }

    async fn dra_call(
        &self,
        verb: &'static str,
        method: Method,
        path: String,
        what: String,
        body: Option<&Value>,
    ) -> Result<Value, KubeError> {
        let method_name = match method {
            Method::GET => "GET",
            Method::POST => "POST",
            Method::PUT => "PUT",
            Method::DELETE => "DELETE",
            _ => "PATCH",
        };
        let fail = |failure| KubeError::Dra {
            verb,
            what: what.clone(),
            method: method_name,
            path: path.clone(),
            failure,
        };
        let body = body.map(|b| ("application/json", b.to_string().into_bytes()));
        let limit = Limit::Total(self.inner.request_timeout);
        let mut response = self.send(verb, method, &path, body, limit).await.map_err(fail)?;
        if verb == "delete" {
            drain_body(response, MAX_API_BODY).await;
            return Ok(Value::Null);
        }
        let text = read_body(&mut response, MAX_API_BODY)
            .await
            .map_err(|e| fail(body_failure(e)))?;
        serde_json::from_slice(&text).map_err(|e| fail(ApiFailure::Decode(e.to_string())))
    }
}

fn slice_name(slice: &Value) -> &str {
    slice.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("")
}
