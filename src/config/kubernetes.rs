//! `[kubernetes]`, `[desired]` and `[labels]`: the link to the Node (the API server, or a labels
//! file instead) and the label keys read and written; their defaults and validation.

use super::values;
use super::{Check, absolute_path, invalid, positive};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Talk to the Kubernetes API server at all.
pub const DEFAULT_KUBERNETES_ENABLED: bool = true;
/// Watch the Node (else poll it).
pub const DEFAULT_KUBERNETES_WATCH: bool = true;
/// Poll period when watching is off or failing.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(60);
/// Server-side length of one watch request (`timeoutSeconds`); a reconnect follows.
pub const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// Limit on one API request (not on a watch stream).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// First retry delay after an API error; doubles, with jitter, up to `backoff_max`.
pub const DEFAULT_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Longest retry delay after API errors.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5 * 60);
/// Window every reconnect attempt after a dropped API server connection is spread over (a
/// uniformly random delay in it), so that a fleet whose watches all dropped at once (an API
/// server restart) does not come back at once.
pub const DEFAULT_RECONNECT_JITTER: Duration = Duration::from_secs(10);
/// Kubeconfigs tried, in order, when neither `kubeconfig` nor `$KUBECONFIG` names one: the
/// kubelet's own on kubeadm, EKS (AL2 and AL2023), GKE, k3s and RKE2 nodes.
pub const DEFAULT_KUBECONFIG_SEARCH: &[&str] = &[
    "/etc/kubernetes/kubelet.conf",
    "/var/lib/kubelet/kubeconfig",
    "/etc/kubernetes/kubelet/kubeconfig",
    "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
    "/var/lib/rancher/rke2/agent/kubelet.kubeconfig",
];
/// The in-cluster service account directory (token, ca.crt, namespace).
pub const DEFAULT_IN_CLUSTER_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Post Kubernetes Events on the Node for state transitions.
pub const DEFAULT_EVENTS: bool = true;
/// Send a bearer token (or an exec plugin's token) to a plain `http://` API server.
pub const DEFAULT_ALLOW_INSECURE_HTTP: bool = false;
/// Set the GPU Operator's `nvidia.com/gpu.deploy.<operand>=false` on the agent's own Node for
/// every operand the agent replaces.
pub const DEFAULT_WITHDRAW_OPERATOR_OPERANDS: bool = false;
/// The namespace NVIDIA's GPU Operator runs its operands in (its Helm chart's default).
pub const DEFAULT_OPERATOR_NAMESPACE: &str = "gpu-operator";

/// Label naming the desired MIG layout.
pub const DEFAULT_LABEL_MIG_CONFIG: &str = "nvidia.com/mig.config";
/// Label the agent writes with the MIG layout's state.
pub const DEFAULT_LABEL_MIG_CONFIG_STATE: &str = "nvidia.com/mig.config.state";
/// Label naming the desired device plugin profile.
pub const DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG: &str = "nvidia.com/device-plugin.config";
/// Label the agent writes with the device plugin profile's state (its own addition).
pub const DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG_STATE: &str = "nvidia.com/device-plugin.config.state";
/// Label the agent writes with the validation stage's state (its own addition).
pub const DEFAULT_LABEL_VALIDATION_STATE: &str = "nvidia.com/gpu-node-agent.validation.state";

/// Prefix of the reported GPU feature labels (GPU Feature Discovery's).
pub const DEFAULT_FEATURE_PREFIX: &str = "nvidia.com/";
/// Report the GPU feature labels.
pub const DEFAULT_REPORT_FEATURES: bool = true;

/// `[kubernetes]`: the API server connection used to read the Node's labels and report back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Talk to the API server; `false` runs on the labels file or the config alone.
    pub enabled: bool,
    /// Kubeconfig to use (host path); empty: `$KUBECONFIG`, then `kubeconfig_search`, then the
    /// in-cluster service account.
    pub kubeconfig: PathBuf,
    /// Kubeconfigs tried in order when none is named (host paths).
    pub kubeconfig_search: Vec<PathBuf>,
    /// In-cluster service account directory (host path), used with
    /// `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT`.
    pub in_cluster_dir: PathBuf,
    /// This node's name; empty: `$NODE_NAME`, then the hostname.
    pub node_name: String,
    /// Watch the Node; `false` polls every `poll_interval`.
    pub watch: bool,
    /// Poll period when not watching (and while a watch cannot be established).
    #[serde(with = "values::duration")]
    pub poll_interval: Duration,
    /// Length of one watch request before it is renewed.
    #[serde(with = "values::duration")]
    pub watch_timeout: Duration,
    /// Limit on one request.
    #[serde(with = "values::duration")]
    pub request_timeout: Duration,
    /// First retry delay after an error; doubles with jitter up to `backoff_max`.
    #[serde(with = "values::duration")]
    pub backoff_min: Duration,
    /// Longest retry delay.
    #[serde(with = "values::duration")]
    pub backoff_max: Duration,
    /// Every retry while the API server cannot be reached waits a random time of up to this long
    /// (or the backoff's step, when longer), so that thousands of nodes that lost the API server
    /// together (a restart) come back spread over this window once it answers; `0s` turns the
    /// spread off. Cut to `backoff_max` when longer.
    #[serde(with = "values::duration")]
    pub reconnect_jitter: Duration,
    /// Post Events on the Node for state transitions.
    pub events: bool,
    /// Allow sending a bearer token (inline, `tokenFile`, or from an exec plugin) to an API
    /// server whose URL is plain `http://`, where anyone on the path can read it. `false` (the
    /// default) refuses such a kubeconfig; an `http://` server without credentials works either
    /// way.
    pub allow_insecure_http: bool,
    /// Migrating from NVIDIA's GPU Operator: set `nvidia.com/gpu.deploy.<operand>=false` on this
    /// Node for each operand the agent replaces with its config (the Operator then removes them
    /// from the node), keeping each label's previous value for `gpu-node-agent migrate --undo`.
    /// The agent serves, applies and configures what an operand held only once it has left.
    pub withdraw_operator_operands: bool,
    /// The namespace NVIDIA's GPU Operator runs its operands in. A process under an operand's
    /// name (`nvidia-mig-manager`, `nvidia-toolkit`, ...) in a pod counts as the Operator's only
    /// when its pod is in this namespace; one outside the pods (a host service) always counts.
    pub operator_namespace: String,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            enabled: DEFAULT_KUBERNETES_ENABLED,
            kubeconfig: PathBuf::new(),
            kubeconfig_search: DEFAULT_KUBECONFIG_SEARCH.iter().map(PathBuf::from).collect(),
            in_cluster_dir: DEFAULT_IN_CLUSTER_DIR.into(),
            node_name: String::new(),
            watch: DEFAULT_KUBERNETES_WATCH,
            poll_interval: DEFAULT_POLL_INTERVAL,
            watch_timeout: DEFAULT_WATCH_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            backoff_min: DEFAULT_BACKOFF_MIN,
            backoff_max: DEFAULT_BACKOFF_MAX,
            reconnect_jitter: DEFAULT_RECONNECT_JITTER,
            events: DEFAULT_EVENTS,
            allow_insecure_http: DEFAULT_ALLOW_INSECURE_HTTP,
            withdraw_operator_operands: DEFAULT_WITHDRAW_OPERATOR_OPERANDS,
            operator_namespace: DEFAULT_OPERATOR_NAMESPACE.into(),
        }
    }
}

impl KubernetesConfig {
    pub(super) fn validate(&self) -> Check {
        if !self.kubeconfig.as_os_str().is_empty() {
            absolute_path("kubernetes.kubeconfig", &self.kubeconfig)?;
        }
        for (i, p) in self.kubeconfig_search.iter().enumerate() {
            absolute_path(&format!("kubernetes.kubeconfig_search[{i}]"), p)?;
        }
        absolute_path("kubernetes.in_cluster_dir", &self.in_cluster_dir)?;
        if !self.node_name.is_empty() && !crate::names::is_dns_subdomain(&self.node_name) {
            return Err(invalid(
                "kubernetes.node_name",
                "expected a DNS subdomain name, as Node names are",
            ));
        }
        if !is_dns_label(&self.operator_namespace) {
            return Err(invalid(
                "kubernetes.operator_namespace",
                "expected a namespace name (a DNS label: at most 63 lower-case letters, digits and '-', starting \
                 and ending with a letter or digit), e.g. \"gpu-operator\"",
            ));
        }
        positive("kubernetes.poll_interval", self.poll_interval)?;
        positive("kubernetes.watch_timeout", self.watch_timeout)?;
        positive("kubernetes.request_timeout", self.request_timeout)?;
        positive("kubernetes.backoff_min", self.backoff_min)?;
        if self.backoff_max < self.backoff_min {
            return Err(invalid(
                "kubernetes.backoff_max",
                "expected at least kubernetes.backoff_min",
            ));
        }
        Ok(())
    }
}

/// Whether `s` is a DNS label as Kubernetes checks a namespace name (RFC 1123): 1 to 63
/// lower-case letters, digits and '-', a letter or digit at both ends.
fn is_dns_label(s: &str) -> bool {
    !s.contains('.') && s.len() <= 63 && crate::names::is_dns_subdomain(s)
}

/// `[desired]`: where the desired state comes from when not from the Node's labels.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DesiredConfig {
    /// A file of `key=value` label lines (host path), re-read when it changes, used instead of
    /// the Node's labels; empty: none.
    pub labels_file: PathBuf,
}

impl DesiredConfig {
    pub(super) fn validate(&self) -> Check {
        if self.labels_file.as_os_str().is_empty() {
            return Ok(());
        }
        absolute_path("desired.labels_file", &self.labels_file)
    }
}

/// `[labels]`: the label keys read and written (GPU Operator compatible by default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LabelsConfig {
    /// Desired MIG layout.
    pub mig_config: String,
    /// Reported MIG layout state: pending | rebooting | success | failed.
    pub mig_config_state: String,
    /// Desired device plugin profile.
    pub device_plugin_config: String,
    /// Reported device plugin profile state: success | failed.
    pub device_plugin_config_state: String,
    /// Reported validation stage state: success | failed | pending.
    pub validation_state: String,
    /// Prefix of the GPU feature labels (`<prefix>gpu.product`, ...).
    pub feature_prefix: String,
    /// Report the GPU feature labels.
    pub report_features: bool,
}

impl Default for LabelsConfig {
    fn default() -> Self {
        LabelsConfig {
            mig_config: DEFAULT_LABEL_MIG_CONFIG.into(),
            mig_config_state: DEFAULT_LABEL_MIG_CONFIG_STATE.into(),
            device_plugin_config: DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG.into(),
            device_plugin_config_state: DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG_STATE.into(),
            validation_state: DEFAULT_LABEL_VALIDATION_STATE.into(),
            feature_prefix: DEFAULT_FEATURE_PREFIX.into(),
            report_features: DEFAULT_REPORT_FEATURES,
        }
    }
}

impl LabelsConfig {
    pub(super) fn validate(&self) -> Check {
        for (key, value) in [
            ("labels.mig_config", &self.mig_config),
            ("labels.mig_config_state", &self.mig_config_state),
            ("labels.device_plugin_config", &self.device_plugin_config),
            ("labels.device_plugin_config_state", &self.device_plugin_config_state),
            ("labels.validation_state", &self.validation_state),
        ] {
            crate::names::check_label_key(value).map_err(|reason| invalid(key, reason))?;
        }
        let prefix_ok = self
            .feature_prefix
            .strip_suffix('/')
            .is_some_and(crate::names::is_dns_subdomain);
        if !prefix_ok {
            return Err(invalid(
                "labels.feature_prefix",
                "expected a DNS name followed by '/', e.g. \"nvidia.com/\"",
            ));
        }
        Ok(())
    }
}
