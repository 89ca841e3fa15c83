//! docker behind the engine seam ([`ContainerEngine`]): one file, `daemon.json`; its version is
//! asked only under `cdi-only`, where the agent relies on its CDI (25 and later); it serves no
//! CRI itself (the kubelet reaches it through cri-dockerd).

use crate::config::Engine;
use crate::runtime::engine::{
    ContainerEngine, Edit, EngineFacts, EngineFile, Host, ObservedEngine, PlanContext, Seen, engine_version,
};
use crate::runtime::{EditError, NvidiaRuntime};

/// docker (`dockerd`).
#[derive(Debug, Clone, Copy)]
pub struct DockerEngine;

impl ContainerEngine for DockerEngine {
    fn kind(&self) -> Engine {
        Engine::Docker
    }

    /// Docker has CDI from 25 on: its version is asked only where the agent relies on it.
    fn observe(&self, host: &Host, seen: &Seen) -> EngineFacts {
        let version = match seen.binary {
            Some(binary) if seen.selected && seen.cdi_only => engine_version(host.runner, binary),
            _ => None,
        };
        EngineFacts {
            version,
            ..EngineFacts::default()
        }
    }

    fn first_cdi(&self) -> (u32, u32) {
        (25, 0)
    }

    fn configure(&self, e: &ObservedEngine, _cx: &PlanContext, rt: &NvidiaRuntime) -> Result<Edit, EditError> {
        let text = super::configure(e.main.as_deref(), &e.files.config.to_string_lossy(), rt)?;
        Ok(Edit::Files(vec![(EngineFile::Main, Some(text))]))
    }

    fn unconfigure(
        &self,
        e: &ObservedEngine,
        main: &str,
        names: &[&str],
        original: Option<&str>,
    ) -> Result<String, EditError> {
        super::unconfigure(main, &e.files.config.to_string_lossy(), names, original)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;
    use crate::runtime::DefaultRuntime;
    use crate::runtime::engine::tests::observed;

    /// Through the seam, without the stage: `daemon.json` gets the runtime and, under
    /// `unconfigure`, loses it again; docker has no drop-in and no CRI of its own.
    #[test]
    fn the_docker_engine_edits_daemon_json_only() {
        let engine: &dyn ContainerEngine = &DockerEngine;
        let files = Config::default().runtime.files(engine.kind());
        let rt = NvidiaRuntime {
            name: "nvidia".into(),
            binary: "/usr/bin/nvidia-container-runtime".into(),
            default: DefaultRuntime::Set,
            enable_cdi: false,
            also: Vec::new(),
            runtimes: true,
        };
        let cx = PlanContext {
            cdi_dir: Path::new("/var/run/cdi"),
            drop_in_backed_up: false,
        };
        let before = "{\n  \"log-level\": \"warn\"\n}\n";
        let e = observed(engine.kind(), files, Some(before), None);
        let Edit::Files(writes) = engine.configure(&e, &cx, &rt).unwrap() else {
            panic!("files expected");
        };
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].0, EngineFile::Main);
        let after = writes[0].1.clone().unwrap();
        assert!(after.contains("\"default-runtime\": \"nvidia\""), "{after}");
        assert!(after.contains("\"log-level\": \"warn\""), "{after}");
        let back = engine.unconfigure(&e, &after, &["nvidia"], Some(before)).unwrap();
        assert!(!back.contains("nvidia"), "{back}");
        assert_eq!(engine.first_cdi(), (25, 0));
        assert_eq!(
            engine.cri_load_error(
                &crate::host::command::Runner::new(&crate::host::HostRoot::new("/")),
                None,
                Path::new("/x")
            ),
            None
        );
    }
}
