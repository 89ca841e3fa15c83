//! The `gpu-node-agent` binary: parses the command line and runs one command.

use std::process::ExitCode;

use clap::Parser;

use gpu_node_agent::agent::{self, summary};
use gpu_node_agent::cli::{
    CdiCommand, Cli, Command, ConfigCommand, DriverCommand, HookCommand, MigCommand, RuntimeCommand, ValidateCommand,
};
use gpu_node_agent::config::Config;
use gpu_node_agent::exit::Exit;
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::host::lock::StateLock;
use gpu_node_agent::{logging, plan};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run { .. }) {
        quiet_on_closed_pipe();
    }
    let root = HostRoot::new(&cli.global.root);
    // A CDI hook runs for every container start: no config, no lock, no logging set up.
    if let Command::Cdi {
        command: CdiCommand::Hook { hook },
    } = &cli.command
    {
        return cdi_hook(hook);
    }
    if let Command::Version = cli.command {
        println!("gpu-node-agent {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    // Config first: an invalid config exits before anything is touched.
    let (mut config, files) = match Config::load(root.path(), cli.global.config.as_deref()) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("gpu-node-agent: invalid configuration: {e}");
            return exit(e.exit_code());
        }
    };
    // `auto` values are decided once, against this node: every command sees the same.
    let as_written = matches!(
        cli.command,
        Command::Config {
            command: ConfigCommand::Check
        }
    )
    .then(|| config.clone());
    let decided = config.resolve_auto_on(root.path());
    // One writer per node: the daemon and the commands that change the node hold the state
    // dir's lock while they run; a second one is refused, naming the first.
    let _lock = match writer(&cli.command) {
        Some(what) => match StateLock::acquire(&root.join(&config.agent.state_dir), what) {
            Ok(lock) => Some(lock),
            Err(e) => {
                eprintln!("gpu-node-agent: {what}: {e}");
                return Exit::TryLater.into();
            }
        },
        None => None,
    };
    match cli.command {
        Command::Version => ExitCode::SUCCESS,
        Command::Config {
            command: ConfigCommand::Check,
        } => {
            if files.is_empty() {
                println!("# no config files found: defaults apply");
            }
            for file in &files {
                println!("# read {file}");
            }
            if let Some(decided) = &decided {
                println!("# on this node: {decided}");
            }
            match toml::to_string_pretty(as_written.as_ref().unwrap_or(&config)) {
                Ok(text) => {
                    println!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: cannot print the effective config: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Status { json } => gpu_node_agent::status::status_command(&config, &root, json),
        Command::Mig { command } => agent::mig_command(&config, &root, command),
        Command::Migrate { undo } => agent::migrate_command(&config, &root, undo),
        Command::Validate {
            command: ValidateCommand::Cuda { json, driver_root },
        } => {
            let driver_root = driver_root.unwrap_or_else(|| config.device_plugin.driver_root.clone());
            let result = gpu_node_agent::cuda::check(root.path(), &driver_root);
            if json {
                println!("{}", serde_json::to_string(&result).unwrap_or_default());
            } else {
                match &result {
                    gpu_node_agent::cuda::CudaCheck::Passed { driver_api, gpus } => {
                        println!(
                            "CUDA {driver_api}: the check kernel ran on {} GPU(s): {}",
                            gpus.len(),
                            gpus.join(", ")
                        )
                    }
                    gpu_node_agent::cuda::CudaCheck::NotAvailable { reason } => {
                        println!("CUDA not available: {reason}")
                    }
                    gpu_node_agent::cuda::CudaCheck::Failed { reason } => {
                        eprintln!("gpu-node-agent: CUDA check failed: {reason}")
                    }
                }
            }
            match result {
                gpu_node_agent::cuda::CudaCheck::Failed { .. } => ExitCode::FAILURE,
                _ => ExitCode::SUCCESS,
            }
        }
        Command::Driver { command } => agent::driver_command(&config, &root, command),
        Command::Runtime { command } => agent::runtime_command(&config, &root, command),
        Command::Cdi {
            command: CdiCommand::Generate { output },
        } => agent::cdi_generate(&config, &root, output.as_deref()),
        Command::Cdi {
            command: CdiCommand::Hook { hook },
        } => cdi_hook(&hook),
        Command::Plan { json, mig_layout } => {
            logging::init(&config.log);
            if let Some(name) = &mig_layout
                && config.mig.layout(name).is_none()
            {
                eprintln!(
                    "gpu-node-agent: no MIG layout named {name:?}; defined: {}",
                    config.mig.layout_names().join(", ")
                );
                return Exit::Usage.into();
            }
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("gpu-node-agent: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let planned = runtime.block_on(agent::plan::node_plan(&config, &root, mig_layout.as_deref()));
            match planned {
                Ok(p) => {
                    if json {
                        println!("{}", plan::to_json(&p));
                    } else {
                        print!("{}", plan::render(&p));
                    }
                    match &p.mig {
                        Some(m) if !m.incomplete && m.error.is_some() => {
                            eprintln!(
                                "gpu-node-agent: MIG layout {}: {}",
                                m.layout,
                                m.error.as_deref().unwrap_or_default()
                            );
                            ExitCode::FAILURE
                        }
                        _ => ExitCode::SUCCESS,
                    }
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: {e}");
                    exit(e.exit_code())
                }
            }
        }
        Command::Run { once } => {
            logging::init(&config.log);
            tracing::info!(
                "gpu-node-agent {} starting (root {}, config {})",
                env!("CARGO_PKG_VERSION"),
                root.path().display(),
                if files.is_empty() {
                    "defaults".to_string()
                } else {
                    files.join(", ")
                }
            );
            if let Some(decided) = &decided {
                tracing::info!("on this node: {decided}");
            }
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("gpu-node-agent: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(agent::run(config, root, once)) {
                Ok(code) => exit(code),
                Err(e) => {
                    tracing::error!("{e}");
                    eprintln!("gpu-node-agent: {e}");
                    let _ = summary;
                    exit(e.exit_code())
                }
            }
        }
    }
}

/// `cdi hook <name>`: the hook's arguments from the command line, the OCI state from standard
/// input; a failure is one line on standard error (the runtime shows it) and exit 1.
fn cdi_hook(command: &HookCommand) -> ExitCode {
    use gpu_node_agent::runtime::cdi::hook::{self, Hook};
    let hook = match command {
        HookCommand::CreateSymlinks { links } => match links.iter().map(|l| hook::parse_link(l)).collect() {
            Ok(links) => Hook::CreateSymlinks { links },
            Err(e) => {
                eprintln!("gpu-node-agent cdi hook create-symlinks: {e}");
                return Exit::Usage.into();
            }
        },
        HookCommand::UpdateLdcache { folders, ldconfig_path } => Hook::UpdateLdcache {
            folders: folders.clone(),
            ldconfig: ldconfig_path.clone(),
        },
        HookCommand::EnableCudaCompat { host_driver_version } => Hook::EnableCudaCompat {
            host_driver_version: host_driver_version.clone(),
        },
        HookCommand::DisableDeviceNodeModification => Hook::DisableDeviceNodeModification,
    };
    match hook::run(&hook, std::io::stdin().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-node-agent cdi hook {}: {e}", hook.name());
            ExitCode::FAILURE
        }
    }
}

/// The commands that change the node, as the lock records them; `None` for those that only read.
fn writer(command: &Command) -> Option<&'static str> {
    match command {
        Command::Run { once: false } => Some("run"),
        Command::Run { once: true } => Some("run --once"),
        Command::Mig {
            command: MigCommand::Apply { .. },
        } => Some("mig apply"),
        Command::Runtime {
            command: RuntimeCommand::Configure { dry_run: false, .. },
        } => Some("runtime configure"),
        Command::Runtime {
            command: RuntimeCommand::Unconfigure { .. },
        } => Some("runtime unconfigure"),
        Command::Driver {
            command: DriverCommand::Install,
        } => Some("driver install"),
        Command::Cdi {
            command: CdiCommand::Generate { output: None },
        } => Some("cdi generate"),
        _ => None,
    }
}

/// A command whose reader went away (`config check | head -1`) ends quietly, like a Unix tool:
/// Rust ignores SIGPIPE and makes `println!` panic on EPIPE instead, so the default action is put
/// back. Not for `run`: a daemon whose journal stream closes keeps running.
fn quiet_on_closed_pipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: called first thing in `main`, before any thread exists; SIG_DFL installs no
    // handler code.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
