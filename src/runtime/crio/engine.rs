//! CRI-O behind the engine seam ([`ContainerEngine`]): the agent's drop-in in `crio.conf.d/`,
//! made knowing the other drop-ins there (CRI-O reads them in name order); CDI in every version,
//! whatever its configuration; its CRI socket at CRI-O's default.

use std::path::PathBuf;

use crate::config::{AnyEngineFiles, Engine};
use crate::host::HostRoot;
use crate::runtime::engine::{
    ContainerEngine, Edit, EngineFacts, EngineFile, Host, ImportedFile, ObservedEngine, PlanContext, Seen,
    read_resolved, resolve,
};
use crate::runtime::{EditError, NvidiaRuntime};

/// CRI-O's CRI socket (its `listen` default).
const CRIO_SOCKET: &str = "/var/run/crio/crio.sock";

/// CRI-O.
#[derive(Debug, Clone, Copy)]
pub struct CrioEngine;

impl ContainerEngine for CrioEngine {
    fn kind(&self) -> Engine {
        Engine::Crio
    }

    fn observe(&self, host: &Host, seen: &Seen) -> EngineFacts {
        EngineFacts {
            imported: if seen.selected {
                drop_ins(host.root, seen.files)
            } else {
                Vec::new()
            },
            cri_socket: Some(PathBuf::from(CRIO_SOCKET)),
            ..EngineFacts::default()
        }
    }

    /// CRI-O reads CDI specs (from /etc/cdi and /var/run/cdi) whatever its configuration: under
    /// `cdi-only` the agent's drop-in, which only ever holds its runtimes, goes.
    fn configure(&self, e: &ObservedEngine, _cx: &PlanContext, rt: &NvidiaRuntime) -> Result<Edit, EditError> {
        if !rt.runtimes {
            return Ok(Edit::Files(vec![(EngineFile::DropIn, None)]));
        }
        let main_file = e.files.config.to_string_lossy();
        let drop_ins: Vec<(String, String)> = e.imported.iter().map(|f| (f.file.clone(), f.text.clone())).collect();
        let text = super::configure_with_drop_ins(e.main.as_deref(), &main_file, &drop_ins, rt)?;
        Ok(Edit::Files(vec![(EngineFile::DropIn, Some(text))]))
    }
}

/// The files of CRI-O's drop-in directory (the agent's drop-in's directory, `crio.conf.d/`) in
/// the name order CRI-O reads them, without the agent's own; unreadable ones are left out
/// (logged).
fn drop_ins(root: &HostRoot, files: &AnyEngineFiles) -> Vec<ImportedFile> {
    let Some(dir) = files.drop_in.parent() else {
        return Vec::new();
    };
    let Some(entries) = resolve(root, dir)
        .ok()
        .and_then(|real| std::fs::read_dir(root.join(real)).ok())
    else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let path = dir.join(&name);
        if path == files.drop_in {
            continue;
        }
        match read_resolved(root, &path) {
            Ok(Some(text)) => out.push(ImportedFile {
                file: path.to_string_lossy().into_owned(),
                text,
            }),
            Ok(None) => {}
            Err(e) => tracing::warn!("CRI-O drop-in {}: {e}", path.display()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;
    use crate::host::command::Runner;
    use crate::runtime::DefaultRuntime;
    use crate::runtime::engine::tests::{host, observed};

    /// Through the seam, without the stage: the other drop-ins are observed in name order (the
    /// agent's own and hidden files left out), the agent's drop-in is written, and under
    /// `cdi-only` it goes.
    #[test]
    fn the_crio_engine_reads_its_drop_ins_and_plans_its_own() {
        let engine: &dyn ContainerEngine = &CrioEngine;
        let files = Config::default().runtime.files(engine.kind());
        let (_tmp, root) = host(
            &[
                ("/etc/crio/crio.conf.d/10-b.conf", "[crio.runtime]\n"),
                ("/etc/crio/crio.conf.d/01-a.conf", "[crio.runtime]\n"),
                ("/etc/crio/crio.conf.d/.hidden", "x"),
                ("/etc/crio/crio.conf.d/99-nvidia.toml", "old"),
            ],
            &[],
        );
        let runner = Runner::new(&root);
        let state = root.join("/var/lib/gpu-node-agent/runtime");
        let host = Host {
            root: &root,
            runner: &runner,
            state: &state,
        };
        let seen = Seen {
            files: &files,
            binary: None,
            main: None,
            selected: true,
            cdi_only: false,
        };
        let facts = engine.observe(&host, &seen);
        let names: Vec<&str> = facts.imported.iter().map(|f| f.file.as_str()).collect();
        assert_eq!(
            names,
            ["/etc/crio/crio.conf.d/01-a.conf", "/etc/crio/crio.conf.d/10-b.conf"]
        );
        assert_eq!(facts.cri_socket.as_deref(), Some(Path::new(CRIO_SOCKET)));

        let mut rt = NvidiaRuntime {
            name: "nvidia".into(),
            binary: "/usr/bin/nvidia-container-runtime".into(),
            default: DefaultRuntime::Keep,
            enable_cdi: true,
            also: Vec::new(),
            runtimes: true,
        };
        let cx = PlanContext {
            cdi_dir: Path::new("/var/run/cdi"),
            drop_in_backed_up: true,
        };
        let mut e = observed(engine.kind(), files, None, Some("old"));
        e.imported = facts.imported;
        let Edit::Files(writes) = engine.configure(&e, &cx, &rt).unwrap() else {
            panic!("files expected");
        };
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].0, EngineFile::DropIn);
        assert!(
            writes[0].1.as_deref().is_some_and(|t| t.contains("nvidia")),
            "{writes:?}"
        );
        rt.runtimes = false;
        assert_eq!(
            engine.configure(&e, &cx, &rt).unwrap(),
            Edit::Files(vec![(EngineFile::DropIn, None)])
        );
        assert_eq!(engine.first_cdi(), (0, 0));
    }
}
