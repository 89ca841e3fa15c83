//! DRA objects (resource.k8s.io/v1): ResourceSlices (CRUD, selectors, validation, node
//! restriction) and ResourceClaims (get-only for nodes, the library API tests put them in with).

mod common;

use common::{TOKEN, USER, client, rv, server};
use reqwest::Method;
use serde_json::{Value, json};
use test_apiserver::{Failure, TestApiServer};

const NODE: &str = "gpu-node-1";
const NODE_USER: &str = "system:node:gpu-node-1";
const NODE_TOKEN: &str = "node-token";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";
const MODIFIED: &str = "the object has been modified; please apply your changes to the latest version and try again";

/// A client acting as one user (a bearer token).
struct Api {
    client: reqwest::Client,
    url: String,
    token: &'static str,
}

impl Api {
    fn new(server: &TestApiServer, token: &'static str) -> Api {
        Api {
            client: client(server),
            url: server.url(),
            token,
        }
    }

    async fn call(&self, method: Method, path: &str, content_type: &str, body: Option<&Value>) -> (u16, Value) {
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(self.token);
        if let Some(body) = body {
            req = req.header("Content-Type", content_type).body(body.to_string());
        }
        let resp = req.send().await.expect("send");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("JSON answer"))
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.call(Method::GET, path, "", None).await
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call(Method::POST, path, "application/json", Some(body)).await
    }

    async fn put(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call(Method::PUT, path, "application/json", Some(body)).await
    }

    async fn merge_patch(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call(Method::PATCH, path, "application/merge-patch+json", Some(body))
            .await
    }

    async fn delete(&self, path: &str) -> (u16, Value) {
        self.call(Method::DELETE, path, "", None).await
    }
}

/// The server of `common::server` plus a node credential for `gpu-node-1`.
async fn dra_server() -> (TestApiServer, Api, Api) {
    let server = server().await;
    server.add_token(NODE_TOKEN, NODE_USER);
    let admin = Api::new(&server, TOKEN);
    let node = Api::new(&server, NODE_TOKEN);
    (server, admin, node)
}

fn gpu(minor: u32) -> Value {
    json!({
        "name": format!("gpu-{minor}"),
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": format!("GPU-4f6a1b2c-3d4e-5f60-7182-93a4b5c6d7e{minor}")},
            "productName": {"string": "NVIDIA A100-SXM4-80GB"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Ampere"},
            "cudaComputeCapability": {"version": "8.0.0"},
            "driverVersion": {"version": "550.54.15"},
            "cudaDriverVersion": {"version": "12.4.0"},
            "pcieBusID": {"string": "0000:07:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    })
}

fn mig() -> Value {
    json!({
        "name": "gpu-0-mig-9-4-4",
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": "MIG-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"},
            "parentUUID": {"string": "GPU-4f6a1b2c-3d4e-5f60-7182-93a4b5c6d7e0"},
            "profile": {"string": "3g.40gb"},
            "cudaComputeCapability": {"version": "8.0.0"},
            "driverVersion": {"version": "550.54.15"},
        },
        "capacity": {
            "multiprocessors": {"value": "42"},
            "copyEngines": {"value": "3"},
            "memory": {"value": "40192Mi"},
            "memorySlice4": {"value": "1"},
            "memorySlice5": {"value": 1},
        },
    })
}

fn slice(name: &str, node: &str, devices: Vec<Value>) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    })
}

/// `v` with the member at JSON pointer `at` set (`Some`) or removed (`None`); `~1` in the last
/// segment stands for `/`.
fn edit(mut v: Value, at: &str, new: Option<Value>) -> Value {
    let (parent, key) = at.rsplit_once('/').expect("pointer");
    let key = key.replace("~1", "/");
    let obj = v
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("no object at {parent}"));
    match new {
        Some(n) => obj.insert(key, n),
        None => obj.remove(&key),
    };
    v
}

fn path(name: &str) -> String {
    format!("{SLICES}/{name}")
}

fn names(list: &Value) -> Vec<&str> {
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| i["metadata"]["name"].as_str().expect("name"))
        .collect()
}

#[tokio::test]
async fn slices_create_get_list_update_delete() {
    let (server, admin, _) = dra_server().await;
    let before: u64 = server.resource_version().parse().unwrap();

    let (code, created) = admin.post(SLICES, &slice("s1", NODE, vec![gpu(0), mig()])).await;
    assert_eq!(code, 201, "{created}");
    assert_eq!(
        (created["kind"].as_str(), created["apiVersion"].as_str()),
        (Some("ResourceSlice"), Some("resource.k8s.io/v1"))
    );
    assert_eq!(created["metadata"]["uid"].as_str().unwrap().len(), 36);
    assert!(created["metadata"]["creationTimestamp"].is_string());
    assert_eq!(created["metadata"]["generation"], 1);
    assert!(rv(&created) > before);
    assert_eq!(created["spec"]["devices"][1]["name"], "gpu-0-mig-9-4-4");
    assert_eq!(server.resource_slices()["s1"], created);

    // generateName, and the name conflict.
    let mut generated = slice("", "gpu-node-2", vec![gpu(0)]);
    generated["metadata"] = json!({"generateName": "gpu-node-2-gpu.nvidia.com-"});
    let (code, generated) = admin.post(SLICES, &generated).await;
    assert_eq!(code, 201, "{generated}");
    let generated_name = generated["metadata"]["name"].as_str().unwrap().to_owned();
    assert!(generated_name.starts_with("gpu-node-2-gpu.nvidia.com-") && generated_name.len() == 31);
    let (code, status) = admin.post(SLICES, &slice("s1", NODE, vec![])).await;
    assert_eq!(code, 409);
    assert_eq!(status["reason"], "AlreadyExists");
    assert_eq!(
        status["message"],
        "resourceslices.resource.k8s.io \"s1\" already exists"
    );

    let mut other_driver = slice("s3", NODE, vec![gpu(1)]);
    other_driver["spec"]["driver"] = json!("compute-domain.nvidia.com");
    other_driver["metadata"]["labels"] = json!({"tier": "x"});
    assert_eq!(admin.post(SLICES, &other_driver).await.0, 201);

    let (code, got) = admin.get(&path("s1")).await;
    assert_eq!((code, &got), (200, &created));
    let (code, status) = admin.get(&path("nope")).await;
    assert_eq!(code, 404);
    assert_eq!(
        status,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "resourceslices.resource.k8s.io \"nope\" not found", "reason": "NotFound",
            "details": {"name": "nope", "group": "resource.k8s.io", "kind": "resourceslices"}, "code": 404})
    );

    // Lists and selectors.
    let (code, list) = admin.get(SLICES).await;
    assert_eq!(code, 200);
    assert_eq!(
        (list["kind"].as_str(), list["apiVersion"].as_str()),
        (Some("ResourceSliceList"), Some("resource.k8s.io/v1"))
    );
    assert_eq!(
        list["metadata"]["resourceVersion"].as_str().unwrap(),
        server.resource_version()
    );
    assert_eq!(names(&list), [generated_name.as_str(), "s1", "s3"]);
    assert!(list["items"][0].get("kind").is_none());
    for (selector, want) in [
        ("fieldSelector=spec.nodeName%3Dgpu-node-1", vec!["s1", "s3"]),
        (
            "fieldSelector=spec.nodeName%3D%3Dgpu-node-1,spec.driver%3Dgpu.nvidia.com",
            vec!["s1"],
        ),
        ("fieldSelector=spec.driver!%3Dgpu.nvidia.com", vec!["s3"]),
        ("fieldSelector=metadata.name%3Ds3", vec!["s3"]),
        ("labelSelector=tier%3Dx", vec!["s3"]),
        ("fieldSelector=spec.nodeName%3Dgpu-node-9", vec![]),
    ] {
        let (code, list) = admin.get(&format!("{SLICES}?{selector}")).await;
        assert_eq!(code, 200, "{selector}: {list}");
        assert_eq!(names(&list), want, "{selector}");
    }
    let (code, status) = admin.get(&format!("{SLICES}?fieldSelector=spec.pool.name%3Dx")).await;
    assert_eq!(code, 400);
    assert_eq!(status["message"], "field label not supported: spec.pool.name");

    // PUT: the resourceVersion precondition, generation, no-op writes.
    let mut stale = created.clone();
    stale["metadata"]["resourceVersion"] = json!("1");
    stale["spec"]["pool"]["generation"] = json!(2);
    let (code, status) = admin.put(&path("s1"), &stale).await;
    assert_eq!(code, 409);
    assert_eq!(status["reason"], "Conflict");
    assert_eq!(
        status["message"],
        format!("Operation cannot be fulfilled on resourceslices.resource.k8s.io \"s1\": {MODIFIED}")
    );
    let mut next = created.clone();
    next["spec"]["pool"]["generation"] = json!(2);
    next["spec"]["devices"] = json!([gpu(0)]);
    let (code, updated) = admin.put(&path("s1"), &next).await;
    assert_eq!(code, 200, "{updated}");
    assert!(rv(&updated) > rv(&created));
    assert_eq!(updated["metadata"]["generation"], 2);
    assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);
    assert_eq!(updated["spec"]["devices"].as_array().unwrap().len(), 1);
    let (code, again) = admin.put(&path("s1"), &updated).await;
    assert_eq!(
        (code, &again),
        (200, &updated),
        "a PUT that changes nothing keeps the RV"
    );
    let (code, labelled) = admin
        .merge_patch(&path("s1"), &json!({"metadata": {"labels": {"a": "b"}}}))
        .await;
    assert_eq!(code, 200, "{labelled}");
    assert!(rv(&labelled) > rv(&updated));
    assert_eq!(
        labelled["metadata"]["generation"], 2,
        "metadata changes keep the generation"
    );
    assert_eq!(admin.put(&path("nope"), &slice("nope", NODE, vec![])).await.0, 404);

    // DELETE: Status Success with the uid; then 404.
    let (code, status) = admin.delete(&path("s1")).await;
    assert_eq!(code, 200);
    assert_eq!(
        status,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": {"name": "s1", "group": "resource.k8s.io", "kind": "resourceslices",
                "uid": created["metadata"]["uid"]}})
    );
    assert_eq!(admin.get(&path("s1")).await.0, 404);
    assert_eq!(admin.delete(&path("s1")).await.0, 404);

    // deletecollection with a field selector returns what it deleted.
    let (code, deleted) = admin
        .delete(&format!("{SLICES}?fieldSelector=spec.nodeName%3Dgpu-node-1"))
        .await;
    assert_eq!(code, 200, "{deleted}");
    assert_eq!(deleted["kind"], "ResourceSliceList");
    assert_eq!(names(&deleted), ["s3"]);
    assert_eq!(
        server.resource_slices().into_keys().collect::<Vec<_>>(),
        [generated_name]
    );

    // The request log names the verbs.
    let verbs: Vec<String> = server
        .requests()
        .iter()
        .filter(|r| r.path.starts_with(SLICES))
        .map(|r| r.verb.clone())
        .collect();
    for verb in ["create", "get", "list", "update", "patch", "delete", "deletecollection"] {
        assert!(verbs.iter().any(|v| v == verb), "{verb} in {verbs:?}");
    }
    assert_eq!(server.count("POST", SLICES), 4);
}

#[tokio::test]
async fn delete_preconditions_and_injected_failures() {
    let (server, admin, _) = dra_server().await;
    let (_, created) = admin.post(SLICES, &slice("s1", NODE, vec![gpu(0)])).await;
    let (code, status) = admin
        .call(
            Method::DELETE,
            &path("s1"),
            "application/json",
            Some(&json!({"preconditions": {"resourceVersion": "1"}})),
        )
        .await;
    assert_eq!(code, 409);
    assert_eq!(
        status["message"],
        format!(
            "Operation cannot be fulfilled on resourceslices.resource.k8s.io \"s1\": Precondition failed: \
             ResourceVersion in precondition: 1, ResourceVersion in object meta: {}",
            created["metadata"]["resourceVersion"].as_str().unwrap()
        )
    );
    assert!(server.resource_slices().contains_key("s1"));

    server.fail_next_matching(1, "delete", "resourceslices", Failure::Internal);
    assert_eq!(admin.delete(&path("s1")).await.0, 500);
    let (code, _) = admin
        .call(
            Method::DELETE,
            &path("s1"),
            "application/json",
            Some(&json!({"preconditions": {"uid": created["metadata"]["uid"]}})),
        )
        .await;
    assert_eq!(code, 200);
    assert!(server.resource_slices().is_empty());
}

#[tokio::test]
async fn nvidia_style_slices_are_accepted() {
    let (server, admin, node) = dra_server().await;
    let devices: Vec<Value> = (0..8).map(gpu).chain([mig()]).collect();
    let (code, created) = node
        .post(SLICES, &slice("gpu-node-1-gpu.nvidia.com-x7k2p", NODE, devices))
        .await;
    assert_eq!(code, 201, "{created}");
    assert_eq!(created["spec"]["devices"].as_array().unwrap().len(), 9);

    // The other value forms the API takes.
    let mut odd = gpu(0);
    odd["attributes"] = json!({
        "minor": {"int": 0},
        "index": {"int": -3},
        "present": {"bool": true},
        "fw": {"version": "1.2.3-rc.1+build.5"},
        "gpu.nvidia.com/x_y": {"string": ""},
    });
    odd["capacity"] = json!({
        "a": {"value": "1"}, "b": {"value": "81920Mi"}, "c": {"value": "42"}, "d": {"value": 42},
        "e": {"value": "100m"}, "f": {"value": "1.5e3"}, "g": {"value": "2k"},
    });
    let (code, created) = admin.post(SLICES, &slice("odd", NODE, vec![odd])).await;
    assert_eq!(code, 201, "{created}");

    // 128 devices with 32 attributes and capacities each: the limits themselves are fine.
    let full: Vec<Value> = (0..128)
        .map(|i| {
            let attrs: serde_json::Map<String, Value> = (0..31).map(|a| (format!("a{a}"), json!({"int": a}))).collect();
            json!({"name": format!("gpu-{i}"), "attributes": attrs, "capacity": {"memory": {"value": "80Gi"}}})
        })
        .collect();
    let (code, created) = admin.post(SLICES, &slice("full", NODE, full)).await;
    assert_eq!(code, 201, "{}", created["message"]);

    // Pools may be any `/`-separated DNS subdomains; other node selections.
    let mut all_nodes = slice("network", "", vec![gpu(0)]);
    all_nodes["spec"] = json!({"driver": "gpu.nvidia.com", "allNodes": true,
        "pool": {"name": "cluster/pool-a.example.com", "generation": 0, "resourceSliceCount": 2},
        "devices": [gpu(0)]});
    assert_eq!(admin.post(SLICES, &all_nodes).await.0, 201);
    let mut selected = all_nodes.clone();
    selected["metadata"]["name"] = json!("selected");
    selected["spec"] = edit(selected["spec"].take(), "/allNodes", None);
    selected["spec"]["nodeSelector"] = json!({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-1"]}]}]});
    assert_eq!(admin.post(SLICES, &selected).await.0, 201);
    assert_eq!(server.resource_slices().len(), 5);
}

/// (edits to a valid slice, field of the expected cause, part of its message).
type Case = (Vec<(&'static str, Option<Value>)>, &'static str, &'static str);

#[tokio::test]
async fn slice_validation() {
    let (server, admin, _) = dra_server().await;
    let base = slice("s1", NODE, vec![gpu(0)]);
    let long_label = "a".repeat(63);
    let cases: Vec<Case> = vec![
        (
            vec![("/metadata/name", Some(json!("Bad_Name")))],
            "metadata.name",
            "a lowercase RFC 1123 subdomain",
        ),
        (
            vec![("/metadata/name", None)],
            "metadata.name",
            "Required value: name or generateName is required",
        ),
        (vec![("/spec/driver", None)], "spec.driver", "Required value"),
        (
            vec![("/spec/driver", Some(json!("gpu_nvidia.com")))],
            "spec.driver",
            "Invalid value: \"gpu_nvidia.com\": a lowercase RFC 1123 subdomain",
        ),
        (
            vec![("/spec/driver", Some(json!(format!("{}.com", "a".repeat(60)))))],
            "spec.driver",
            "Too long: may not be more than 63 bytes",
        ),
        (vec![("/spec/pool/name", None)], "spec.pool.name", "Required value"),
        (
            vec![("/spec/pool/name", Some(json!("a/B")))],
            "spec.pool.name",
            "Invalid value: \"B\"",
        ),
        (
            vec![("/spec/pool/name", Some(json!("a//b")))],
            "spec.pool.name",
            "Invalid value: \"\"",
        ),
        (
            vec![("/spec/pool/name", Some(json!([long_label.as_str(); 4].join("/"))))],
            "spec.pool.name",
            "Too long: may not be more than 253 bytes",
        ),
        (
            vec![("/spec/pool/generation", Some(json!(-1)))],
            "spec.pool.generation",
            "Invalid value: -1: must be greater than or equal to zero",
        ),
        (
            vec![("/spec/pool/resourceSliceCount", Some(json!(0)))],
            "spec.pool.resourceSliceCount",
            "Invalid value: 0: must be greater than zero",
        ),
        (
            vec![("/spec/pool/resourceSliceCount", None)],
            "spec.pool.resourceSliceCount",
            "must be greater than zero",
        ),
        (
            vec![("/spec/nodeName", None)],
            "spec",
            "Required value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is \
             required",
        ),
        (
            vec![("/spec/allNodes", Some(json!(true)))],
            "spec",
            "Invalid value: \"{`nodeName`, `allNodes`}\": exactly one of `nodeName`, `nodeSelector`, `allNodes`, \
             `perDeviceNodeSelection` is required, but multiple fields are set",
        ),
        (
            vec![("/spec/nodeName", Some(json!("")))],
            "spec.nodeName",
            "must be either unset or set to a non-empty string",
        ),
        (
            vec![("/spec/nodeName", Some(json!("Node_1")))],
            "spec.nodeName",
            "Invalid value: \"Node_1\"",
        ),
        (
            vec![("/spec/nodeName", None), ("/spec/allNodes", Some(json!(false)))],
            "spec.allNodes",
            "Invalid value: false: must be either unset or set to true",
        ),
        (
            vec![
                ("/spec/nodeName", None),
                ("/spec/nodeSelector", Some(json!({"nodeSelectorTerms": [{}, {}]}))),
            ],
            "spec.nodeSelector.nodeSelectorTerms",
            "must have exactly one node selector term",
        ),
        (
            vec![(
                "/spec/sharedCounters",
                Some(json!([{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}])),
            )],
            "spec",
            "only one of `sharedCounters` or `devices` is allowed",
        ),
        (
            vec![("/spec/devices", Some(Value::Array((0..129).map(gpu).collect())))],
            "spec.devices",
            "Too many: 129: must have at most 128 items",
        ),
        (
            vec![("/spec/devices/0/name", Some(json!("GPU-0")))],
            "spec.devices[0].name",
            "a lowercase RFC 1123 label",
        ),
        (
            vec![("/spec/devices/0/name", Some(json!("g".repeat(64))))],
            "spec.devices[0].name",
            "must be no more than 63 characters",
        ),
        (
            vec![("/spec/devices", Some(json!([gpu(0), gpu(1), gpu(0)])))],
            "spec.devices[2]",
            "Duplicate value: \"gpu-0\"",
        ),
        (
            vec![(
                "/spec/devices/0/attributes",
                Some(Value::Object(
                    (0..32).map(|a| (format!("a{a}"), json!({"int": a}))).collect(),
                )),
            )],
            "spec.devices[0]",
            "Invalid value: 33: the total number of attributes and capacities must not exceed 32",
        ),
        (
            vec![("/spec/devices/0/attributes/bad-key", Some(json!({"int": 1})))],
            "spec.devices[0].attributes[bad-key]",
            "a valid C identifier must start with alphabetic character or '_'",
        ),
        (
            vec![(
                "/spec/devices/0/attributes/a234567890123456789012345678901x3",
                Some(json!({"int": 1})),
            )],
            "spec.devices[0].attributes[a234567890123456789012345678901x3]",
            "Too long: may not be more than 32 bytes",
        ),
        (
            vec![("/spec/devices/0/attributes/gpu_nvidia~1x", Some(json!({"int": 1})))],
            "spec.devices[0].attributes[gpu_nvidia/x]",
            "Invalid value: \"gpu_nvidia\"",
        ),
        (
            vec![("/spec/devices/0/attributes/~1x", Some(json!({"int": 1})))],
            "spec.devices[0].attributes[/x]",
            "the domain must not be empty",
        ),
        (
            vec![("/spec/devices/0/attributes/type", Some(json!({})))],
            "spec.devices[0].attributes[type]",
            "Invalid value: \"\": exactly one value must be specified",
        ),
        (
            vec![(
                "/spec/devices/0/attributes/type",
                Some(json!({"string": "gpu", "bool": true})),
            )],
            "spec.devices[0].attributes[type]",
            "exactly one value must be specified",
        ),
        (
            vec![(
                "/spec/devices/0/attributes/uuid",
                Some(json!({"string": "G".repeat(65)})),
            )],
            "spec.devices[0].attributes[uuid].string",
            "Too long: may not be more than 64 bytes",
        ),
        (
            vec![(
                "/spec/devices/0/attributes/cudaComputeCapability",
                Some(json!({"version": "8.0"})),
            )],
            "spec.devices[0].attributes[cudaComputeCapability].version",
            "Invalid value: \"8.0\": must be a string compatible with semver.org spec 2.0.0",
        ),
        (
            vec![(
                "/spec/devices/0/attributes/driverVersion",
                Some(json!({"version": "550.054.15"})),
            )],
            "spec.devices[0].attributes[driverVersion].version",
            "must be a string compatible with semver.org spec 2.0.0",
        ),
        (
            vec![(
                "/spec/devices/0/attributes/driverVersion",
                Some(json!({"version": format!("1.0.0-{}", "a".repeat(60))})),
            )],
            "spec.devices[0].attributes[driverVersion].version",
            "Too long: may not be more than 64 bytes",
        ),
        (
            vec![("/spec/devices/0/capacity/mem-ory", Some(json!({"value": "1"})))],
            "spec.devices[0].capacity[mem-ory]",
            "a valid C identifier",
        ),
        (
            vec![("/spec/devices/0/nodeName", Some(json!(NODE)))],
            "spec.devices[0]",
            "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true",
        ),
    ];
    for (edits, field, fragment) in cases {
        let obj = edits.iter().fold(base.clone(), |v, (at, new)| edit(v, at, new.clone()));
        let (code, status) = admin.post(SLICES, &obj).await;
        assert_eq!(code, 422, "{field} {fragment}: {status}");
        assert_eq!(status["reason"], "Invalid");
        assert_eq!(status["details"]["kind"], "ResourceSlice");
        assert_eq!(status["details"]["group"], "resource.k8s.io");
        let causes = status["details"]["causes"].as_array().expect("causes");
        assert!(
            causes
                .iter()
                .any(|c| c["field"] == field && c["message"].as_str().unwrap().contains(fragment)),
            "want {field}: …{fragment}…, got {causes:#?}"
        );
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .starts_with("ResourceSlice.resource.k8s.io \""),
            "{}",
            status["message"]
        );
    }
    assert!(server.resource_slices().is_empty(), "nothing invalid was stored");
}

#[tokio::test]
async fn undecodable_slices_are_bad_requests() {
    let (server, admin, _) = dra_server().await;
    let base = slice("s1", NODE, vec![gpu(0)]);
    for (at, value, fragment) in [
        (
            "/spec/devices/0/capacity/memory",
            json!({"value": "80GB"}),
            "quantities must match the regular expression",
        ),
        (
            "/spec/devices/0/capacity/memory",
            json!({"value": "80 Gi"}),
            "quantities must match the regular expression",
        ),
        (
            "/spec/devices/0/capacity/memory",
            json!({"value": "1ki"}),
            "unable to parse quantity's suffix",
        ),
        (
            "/spec/devices/0/capacity/memory",
            json!({"value": true}),
            "quantities must match the regular expression",
        ),
        (
            "/spec/devices/0/attributes/minor",
            json!({"int": "1"}),
            "cannot unmarshal string into Go struct field ResourceSlice.spec.devices.attributes.int of type int64",
        ),
        (
            "/spec/devices/0/attributes/minor",
            json!({"int": 1.5}),
            "cannot unmarshal number 1.5",
        ),
        ("/spec/devices/0/attributes/on", json!({"bool": "true"}), "of type bool"),
        (
            "/spec/pool/generation",
            json!("1"),
            "ResourceSlice.spec.pool.generation of type int64",
        ),
        ("/spec/devices", json!({}), "cannot unmarshal object"),
        ("/spec/nodeName", json!(7), "ResourceSlice.spec.nodeName of type string"),
    ] {
        let (code, status) = admin.post(SLICES, &edit(base.clone(), at, Some(value.clone()))).await;
        assert_eq!(code, 400, "{at} = {value}: {status}");
        assert_eq!(status["reason"], "BadRequest");
        let message = status["message"].as_str().unwrap();
        assert!(
            message.starts_with("ResourceSlice in version \"v1\" cannot be handled as a ResourceSlice: ")
                && message.contains(fragment),
            "{at} = {value}: {message}"
        );
    }
    let (code, status) = admin.post(SLICES, &json!([1])).await;
    assert_eq!((code, status["reason"].as_str()), (400, Some("BadRequest")));
    assert!(server.resource_slices().is_empty());
}

#[tokio::test]
async fn immutable_fields_on_update() {
    let (_server, admin, _) = dra_server().await;
    let (_, created) = admin.post(SLICES, &slice("s1", NODE, vec![gpu(0)])).await;
    for (at, value, field, message) in [
        (
            "/spec/driver",
            json!("other.example.com"),
            "spec.driver",
            "Invalid value: \"other.example.com\": field is immutable",
        ),
        (
            "/spec/pool/name",
            json!("pool-b"),
            "spec.pool.name",
            "Invalid value: \"pool-b\": field is immutable",
        ),
        (
            "/spec/nodeName",
            json!("gpu-node-2"),
            "spec.nodeName",
            "Invalid value: \"gpu-node-2\": field is immutable",
        ),
    ] {
        let (code, status) = admin.put(&path("s1"), &edit(created.clone(), at, Some(value))).await;
        assert_eq!(code, 422, "{status}");
        let causes = status["details"]["causes"].as_array().unwrap();
        assert!(
            causes.iter().any(|c| c["field"] == field && c["message"] == message),
            "{causes:#?}"
        );
    }
    // Through a patch too.
    let (code, status) = admin
        .merge_patch(&path("s1"), &json!({"spec": {"driver": "other.example.com"}}))
        .await;
    assert_eq!(code, 422, "{status}");
    // The pool's generation and the devices may change.
    let (code, _) = admin
        .merge_patch(
            &path("s1"),
            &json!({"spec": {"pool": {"generation": 7}, "devices": [gpu(1)]}}),
        )
        .await;
    assert_eq!(code, 200);
}

#[tokio::test]
async fn node_credentials_reach_only_their_own_slices() {
    let (server, admin, node) = dra_server().await;
    // Another node's slice, made by an unrestricted user.
    assert_eq!(
        admin.post(SLICES, &slice("other", "gpu-node-2", vec![gpu(0)])).await.0,
        201
    );

    let (code, own) = node.post(SLICES, &slice("own", NODE, vec![gpu(0)])).await;
    assert_eq!(code, 201, "{own}");
    let (code, status) = node.post(SLICES, &slice("theirs", "gpu-node-2", vec![gpu(0)])).await;
    assert_eq!(code, 403);
    assert_eq!(status["reason"], "Forbidden");
    assert_eq!(
        status["message"],
        "resourceslices.resource.k8s.io \"theirs\" is forbidden: can only create ResourceSlice with the same \
         NodeName as the requesting node"
    );
    let mut everywhere = slice("everywhere", NODE, vec![gpu(0)]);
    everywhere["spec"] = edit(everywhere["spec"].take(), "/nodeName", None);
    everywhere["spec"]["allNodes"] = json!(true);
    assert_eq!(node.post(SLICES, &everywhere).await.0, 403);
    // NodeRestriction comes before validation: an invalid slice for another node is a 403.
    let mut invalid = slice("Invalid_", "gpu-node-2", vec![]);
    invalid["spec"]["driver"] = json!("");
    assert_eq!(node.post(SLICES, &invalid).await.0, 403);

    assert_eq!(node.get(&path("own")).await.0, 200);
    let denied = |verb: &str, name: &str| {
        format!(
            "resourceslices.resource.k8s.io \"{name}\" is forbidden: User \"system:node:gpu-node-1\" cannot {verb} \
             resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope: no relationship \
             found between node 'gpu-node-1' and this object"
        )
    };
    let (code, status) = node.get(&path("other")).await;
    assert_eq!(
        (code, status["message"].as_str()),
        (403, Some(denied("get", "other").as_str()))
    );
    // A slice that does not exist has no graph edge to the node either.
    let (code, status) = node.get(&path("missing")).await;
    assert_eq!(
        (code, status["message"].as_str()),
        (403, Some(denied("get", "missing").as_str()))
    );

    let (_, other) = admin.get(&path("other")).await;
    let (code, status) = node.put(&path("other"), &other).await;
    assert_eq!(
        (code, status["message"].as_str()),
        (403, Some(denied("update", "other").as_str()))
    );
    let (code, _) = node
        .merge_patch(&path("other"), &json!({"spec": {"pool": {"generation": 2}}}))
        .await;
    assert_eq!(code, 403);
    let (code, status) = node.delete(&path("other")).await;
    assert_eq!(
        (code, status["message"].as_str()),
        (403, Some(denied("delete", "other").as_str()))
    );
    assert!(server.resource_slices().contains_key("other"));

    // Own slice: update and patch work; moving it to another node is refused (immutable).
    let mut next = own.clone();
    next["spec"]["pool"]["generation"] = json!(2);
    let (code, updated) = node.put(&path("own"), &next).await;
    assert_eq!(code, 200, "{updated}");
    let (code, _) = node
        .merge_patch(&path("own"), &json!({"spec": {"pool": {"generation": 3}}}))
        .await;
    assert_eq!(code, 200);
    let (code, _) = node
        .merge_patch(&path("own"), &json!({"spec": {"nodeName": "gpu-node-2"}}))
        .await;
    assert_eq!(code, 422);

    // list / watch / deletecollection need spec.nodeName=<own node>.
    let needs_selector = |verb: &str| {
        format!(
            "resourceslices.resource.k8s.io is forbidden: User \"system:node:gpu-node-1\" cannot {verb} resource \
             \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope: can only \
             list/watch/deletecollection resourceslices with nodeName field selector"
        )
    };
    let (code, status) = node.get(SLICES).await;
    assert_eq!(
        (code, status["message"].as_str()),
        (403, Some(needs_selector("list").as_str()))
    );
    for query in [
        "fieldSelector=spec.driver%3Dgpu.nvidia.com",
        "fieldSelector=spec.nodeName%3Dgpu-node-2",
        "fieldSelector=spec.nodeName!%3Dgpu-node-1",
    ] {
        assert_eq!(node.get(&format!("{SLICES}?{query}")).await.0, 403, "{query}");
    }
    let (code, status) = node.get(&format!("{SLICES}?watch=true")).await;
    assert_eq!(
        (code, status["message"].as_str()),
        (403, Some(needs_selector("watch").as_str()))
    );
    let (code, list) = node
        .get(&format!(
            "{SLICES}?fieldSelector=spec.nodeName%3Dgpu-node-1,spec.driver%3Dgpu.nvidia.com"
        ))
        .await;
    assert_eq!(code, 200);
    assert_eq!(names(&list), ["own"]);
    let (code, status) = node.delete(SLICES).await;
    assert_eq!(
        (code, status["message"].as_str()),
        (403, Some(needs_selector("deletecollection").as_str()))
    );
    assert_eq!(server.resource_slices().len(), 2);
    let (code, deleted) = node
        .delete(&format!("{SLICES}?fieldSelector=spec.nodeName%3Dgpu-node-1"))
        .await;
    assert_eq!(code, 200);
    assert_eq!(names(&deleted), ["own"]);
    assert_eq!(server.resource_slices().into_keys().collect::<Vec<_>>(), ["other"]);

    // Own slice delete works; the admin is not restricted.
    assert_eq!(node.post(SLICES, &slice("own", NODE, vec![gpu(0)])).await.0, 201);
    assert_eq!(node.delete(&path("own")).await.0, 200);
    assert_eq!(admin.get(SLICES).await.0, 200);
    assert_eq!(admin.delete(&path("other")).await.0, 200);
}

fn allocated_claim() -> Value {
    json!({
        "metadata": {"namespace": "default", "name": "gpu-claim"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {
            "allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"},
                {"request": "gpu", "driver": "other.example.com", "pool": NODE, "device": "nic-0"},
            ]}},
            "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "0b9a46f4-5f2b-4b59-9b0c-1a2b3c4d5e6f"}],
        },
    })
}

#[tokio::test]
async fn claims_are_get_only_for_nodes() {
    let (server, admin, node) = dra_server().await;
    let stored = server.create_resource_claim(allocated_claim());
    assert_eq!(stored["kind"], "ResourceClaim");
    assert_eq!(stored["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(stored["metadata"]["uid"].as_str().unwrap().len(), 36);
    assert_eq!(stored["status"], allocated_claim()["status"]);

    let (code, got) = node.get(&format!("{CLAIMS}/gpu-claim")).await;
    assert_eq!((code, &got), (200, &stored));
    assert_eq!(
        got["status"]["allocation"]["devices"]["results"][0],
        json!({"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"})
    );
    let (code, status) = node.get(&format!("{CLAIMS}/gone")).await;
    assert_eq!(code, 404);
    assert_eq!(status["message"], "resourceclaims.resource.k8s.io \"gone\" not found");

    let (code, status) = node.get(CLAIMS).await;
    assert_eq!(code, 403);
    assert_eq!(
        status["message"],
        "resourceclaims.resource.k8s.io is forbidden: User \"system:node:gpu-node-1\" cannot list resource \
         \"resourceclaims\" in API group \"resource.k8s.io\" in the namespace \"default\": can only get \
         individual resources of this type"
    );
    assert_eq!(node.get("/apis/resource.k8s.io/v1/resourceclaims").await.0, 403);
    assert_eq!(node.get(&format!("{CLAIMS}?watch=1")).await.0, 403);
    assert_eq!(node.delete(&format!("{CLAIMS}/gpu-claim")).await.0, 403);
    assert_eq!(node.put(&format!("{CLAIMS}/gpu-claim"), &stored).await.0, 403);
    assert_eq!(
        node.merge_patch(&format!("{CLAIMS}/gpu-claim"), &json!({"status": {}}))
            .await
            .0,
        403
    );
    assert_eq!(node.post(CLAIMS, &allocated_claim()).await.0, 403);

    let (code, list) = admin.get(CLAIMS).await;
    assert_eq!(code, 200);
    assert_eq!(list["kind"], "ResourceClaimList");
    assert_eq!(names(&list), ["gpu-claim"]);
    let (code, list) = admin
        .get("/apis/resource.k8s.io/v1/namespaces/other/resourceclaims")
        .await;
    assert_eq!((code, names(&list).len()), (200, 0));
    assert!(server.resource_claim("default", "gpu-claim").is_some());
}

#[tokio::test]
async fn library_api_for_scheduler_and_kubelet_stand_ins() {
    let (server, admin, _) = dra_server().await;

    // Claims: uid kept when given; replaced claims get their new uid; each write bumps the RV.
    let rv0: u64 = server.resource_version().parse().unwrap();
    let mut claim = allocated_claim();
    claim["metadata"]["uid"] = json!("11111111-2222-4333-8444-555555555555");
    let stored = server.create_resource_claim(claim);
    assert_eq!(stored["metadata"]["uid"], "11111111-2222-4333-8444-555555555555");
    assert!(rv(&stored) > rv0);
    let replaced = server.create_resource_claim(allocated_claim());
    assert_ne!(replaced["metadata"]["uid"], stored["metadata"]["uid"]);
    assert!(rv(&replaced) > rv(&stored));
    assert_eq!(server.resource_claim("default", "gpu-claim"), Some(replaced));
    assert!(server.delete_resource_claim("default", "gpu-claim"));
    assert!(!server.delete_resource_claim("default", "gpu-claim"));
    assert_eq!(server.resource_claim("default", "gpu-claim"), None);

    // The kubelet's wipe: by node, and by node and driver.
    for (name, node, driver) in [
        ("a", NODE, "gpu.nvidia.com"),
        ("b", NODE, "compute-domain.nvidia.com"),
        ("c", "gpu-node-2", "gpu.nvidia.com"),
        ("d", NODE, "gpu.nvidia.com"),
    ] {
        let mut s = slice(name, node, vec![gpu(0)]);
        s["spec"]["driver"] = json!(driver);
        assert_eq!(admin.post(SLICES, &s).await.0, 201);
    }
    let rv1: u64 = server.resource_version().parse().unwrap();
    assert_eq!(server.delete_resource_slices(NODE, Some("gpu.nvidia.com")), 2);
    assert!(server.resource_version().parse::<u64>().unwrap() > rv1);
    assert_eq!(server.resource_slices().into_keys().collect::<Vec<_>>(), ["b", "c"]);
    assert_eq!(server.delete_resource_slices(NODE, None), 1);
    assert_eq!(server.delete_resource_slices(NODE, None), 0);
    assert_eq!(server.resource_slices().into_keys().collect::<Vec<_>>(), ["c"]);

    // Faults and denials apply to the new resources by name.
    server.fail_next_matching(1, "create", "resourceslices", Failure::Unavailable);
    assert_eq!(admin.post(SLICES, &slice("e", NODE, vec![])).await.0, 503);
    assert_eq!(admin.post(SLICES, &slice("e", NODE, vec![])).await.0, 201);
    server.forbid(USER, "list", "resourceslices");
    let (code, status) = admin.get(SLICES).await;
    assert_eq!(code, 403);
    assert_eq!(
        status["message"],
        "resourceslices.resource.k8s.io is forbidden: User \"system:serviceaccount:gpu:agent\" cannot list \
         resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope"
    );
    let creates = server
        .requests()
        .iter()
        .filter(|r| r.verb == "create" && r.path == SLICES)
        .count();
    assert_eq!(creates, 6);
}

#[tokio::test]
#[should_panic(expected = "metadata.namespace is required")]
async fn claims_need_a_namespace() {
    let server = TestApiServer::start().await;
    server.create_resource_claim(json!({"metadata": {"name": "c"}}));
}
