//! `gpu-node-agent mig …`: apply, assert, export and import MIG layouts outside the daemon.

use std::process::ExitCode;

use crate::cli::MigCommand;
use crate::config::Config;
use crate::exit::Exit;
use crate::host::HostRoot;
use crate::mig::stage::{ResetGpu, Step, converge, export, plan_layout};
use crate::mig::{import, planner};
use crate::nvml::Gpus;

/// `gpu-node-agent mig …`: the MIG stage's operations by themselves.
pub fn mig_command(config: &Config, root: &HostRoot, command: MigCommand) -> ExitCode {
    if let MigCommand::Import { file } = &command {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("gpu-node-agent: cannot read {}: {e}", file.display());
                return ExitCode::FAILURE;
            }
        };
        return match import::import_mig_parted(&text) {
            Ok(layouts) => {
                println!("# MIG layouts imported from {}", file.display());
                print!("{}", import::to_toml(&layouts));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpu-node-agent: {}: {e}", file.display());
                Exit::Usage.into()
            }
        };
    }
    let layout_of = |name: &str| {
        config.mig.layout(name).ok_or_else(|| {
            format!(
                "no MIG layout named {name:?}; defined: {}",
                config.mig.layout_names().join(", ")
            )
        })
    };
    let gpus = match Gpus::open(&super::nvml_library(config, root)) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return Exit::NoNvml.into();
        }
    };
    match command {
        MigCommand::Import { .. } => ExitCode::SUCCESS,
        MigCommand::Export => match gpus.mig_observe() {
            Ok(observed) => {
                let layouts = std::iter::once(("current".to_string(), export(&observed))).collect();
                print!("{}", import::to_toml(&layouts));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpu-node-agent: {e}");
                ExitCode::FAILURE
            }
        },
        MigCommand::Assert { layout: name } => {
            let layout = match layout_of(&name) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("gpu-node-agent: {e}");
                    return Exit::Usage.into();
                }
            };
            let plans = gpus
                .mig_observe()
                .map_err(|e| e.to_string())
                .and_then(|o| plan_layout(&o, &layout).map_err(|e| e.to_string()));
            match plans {
                Ok(plans) if plans.iter().all(|p| p.ops.is_empty()) => {
                    println!("the GPUs match MIG layout {name}");
                    ExitCode::SUCCESS
                }
                Ok(plans) => {
                    println!("the GPUs do not match MIG layout {name}; applying it would do:");
                    for p in plans.iter().filter(|p| !p.ops.is_empty()) {
                        println!("{}", planner::describe(p));
                    }
                    ExitCode::FAILURE
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: MIG layout {name}: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        MigCommand::Apply { layout: name } => {
            let layout = match layout_of(&name) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("gpu-node-agent: {e}");
                    return Exit::Usage.into();
                }
            };
            let smi = root.join(&config.mig.nvidia_smi);
            let reset = |uuid: &str| crate::host::reset_gpu(&smi, uuid);
            let reset: Option<ResetGpu<'_>> = config.mig.gpu_reset.then_some(&reset);
            match converge(&gpus, &name, &layout, reset, None) {
                Step::Converged => {
                    println!("the GPUs already match MIG layout {name}: nothing to do");
                    ExitCode::SUCCESS
                }
                Step::Applied { mutations, gpus } => {
                    println!(
                        "applied MIG layout {name} to {} GPU(s) ({mutations} NVML operations)",
                        gpus.len()
                    );
                    ExitCode::SUCCESS
                }
                Step::Busy { reason, .. } => {
                    eprintln!("gpu-node-agent: {reason}; nothing changed");
                    Exit::TryLater.into()
                }
                Step::ModePending { reason, .. } | Step::Failed { reason } => {
                    eprintln!("gpu-node-agent: {reason}");
                    ExitCode::FAILURE
                }
                Step::Stopped { mutations } => {
                    eprintln!("gpu-node-agent: stopped after {mutations} NVML operations");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
