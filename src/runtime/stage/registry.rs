//! The engines the stage goes through, in `Engine::ALL`'s order (containerd, docker, CRI-O):
//! the one place that names each implementation of the seam.

use crate::config::Engine;
use crate::runtime::containerd::ContainerdEngine;
use crate::runtime::crio::CrioEngine;
use crate::runtime::docker::DockerEngine;
use crate::runtime::engine::ContainerEngine;

/// Every engine, one per `Engine` (its length is `Engine::ALL`'s, so an engine added there and
/// not here does not compile), at the index of its kind (a test checks it).
pub(super) static ENGINES: [&dyn ContainerEngine; Engine::ALL.len()] = [&ContainerdEngine, &DockerEngine, &CrioEngine];

/// The engine of kind `kind`.
pub(super) fn of(kind: Engine) -> &'static dyn ContainerEngine {
    ENGINES[kind as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_engine_in_order() {
        for (i, kind) in Engine::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i, "{}", kind.as_str());
            assert_eq!(ENGINES[i].kind(), kind);
            assert_eq!(of(kind).kind(), kind);
        }
    }
}
