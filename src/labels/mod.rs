//! The labels the agent reads and writes on its Node.

pub mod gfd;
pub mod report;
pub mod vgpu;
