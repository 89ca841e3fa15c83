//! The kubelet device plugin, hosted in the agent process: one gRPC server per resource on a
//! Unix socket in the kubelet's device-plugin directory, registration with the kubelet,
//! re-registration when the kubelet restarts, health from NVML events, and Allocate /
//! GetPreferredAllocation with NVIDIA's observable behaviour.

pub mod allocate;
pub mod health;
pub mod manager;
pub mod memlimit;
pub mod mps;
pub mod preferred;
pub mod server;
pub mod sharing;
pub mod strategy;
