//! gpu-node-agent: one privileged host agent that replaces the NVIDIA GPU Operator on a
//! Kubernetes node. See ARCHITECTURE.md for the modules and their layers (which module may import
//! which); each module's docs say what it owns.

/// The kubelet device plugin API, v1beta1, generated from the vendored proto.
pub mod api {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1beta1");
}

/// The kubelet's plugin-watcher registration API and DRA node service (v1, v1beta1), generated
/// from the vendored protos (servers only).
pub mod dra_api {
    #![allow(clippy::all, missing_docs)]
    /// `pluginregistration`: what the kubelet calls on a socket in `plugins_registry/`.
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
    /// `k8s.io.kubelet.pkg.apis.dra.v1`: the DRA node service of kubelets 1.34 and later.
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1`: the same service for kubelets 1.32 and 1.33.
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

pub mod agent;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod cuda;
pub mod desired;
pub mod devices;
pub mod dra;
pub mod driver;
pub mod edits;
pub mod exit;
pub mod host;
pub mod kube;
pub mod labels;
pub mod logging;
pub mod metrics;
pub mod mig;
pub mod mig_layout;
pub mod names;
pub mod net;
pub mod notify;
pub mod nvml;
pub mod plan;
pub mod plugin;
pub mod runtime;
pub mod status;
