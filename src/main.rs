//! The `gpu-node-agent` binary: parses the command line and runs one command.

use std::process::ExitCode;

use clap::Parser;

use gpu_node_agent::agent::{self, summary};
use gpu_node_agent::cli::{
    CdiCommand, Cli, Command, ConfigCommand, DriverCommand, MigCommand, RuntimeCommand, ValidateCommand,
};
use gpu_node_agent::config::Config;
use gpu_node_agent::driver::stage as driver_stage;
use gpu_node_agent::exit::Exit;
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::host::command::Runner;
use gpu_node_agent::mig::stage::{ResetGpu, Step, converge, export, plan_layout};
use gpu_node_agent::mig::{import, planner};
use gpu_node_agent::nvml::Gpus;
use gpu_node_agent::runtime::stage as runtime_stage;
use gpu_node_agent::status::{STATUS_FILE, now_unix};
use gpu_node_agent::{logging, plan};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let root = HostRoot::new(&cli.global.root);
    if let Command::Version = cli.command {
        println!("gpu-node-agent {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    // Config first: an invalid config exits before anything is touched.
    let (config, files) = match Config::load(root.path(), cli.global.config.as_deref()) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("gpu-node-agent: invalid configuration: {e}");
            return exit(e.exit_code());
        }
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
            match toml::to_string_pretty(&config) {
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
        Command::Status { json } => status(&config, &root, json),
        Command::Mig { command } => mig(&config, &root, command),
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
        Command::Driver { command } => driver_command(&config, &root, command),
        Command::Runtime { command } => runtime_command(&config, &root, command),
        Command::Cdi {
            command: CdiCommand::Generate { output },
        } => cdi_generate(&config, &root, output.as_deref()),
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

/// Processes on the GPUs, when NVML answers.
fn gpu_processes(config: &Config, root: &HostRoot) -> Option<usize> {
    let gpus = Gpus::open(&agent::nvml_library(config, root)).ok()?;
    let inventory = gpus.inventory(&root.join("/sys")).ok()?;
    inventory
        .gpus
        .iter()
        .map(|g| gpus.process_count(&g.uuid))
        .sum::<Option<usize>>()
}

fn driver_command(config: &Config, root: &HostRoot, command: DriverCommand) -> ExitCode {
    logging::init(&config.log);
    let nvml_view = |pci_gpus: usize| {
        Gpus::open(&agent::nvml_library(config, root))
            .map_err(|e| e.to_string())
            .and_then(|g| driver_stage::nvml_view(&g, pci_gpus))
    };
    let planned = match driver_stage::plan_now(config, root, gpu_processes(config, root)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("gpu-node-agent: driver: {e}");
            return ExitCode::FAILURE;
        }
    };
    match command {
        DriverCommand::Status { json } => {
            let checks = driver_stage::validate_now(config, &planned.facts, nvml_view(planned.facts.gpus.len()));
            if json {
                let value = serde_json::json!({
                    "host": planned.facts,
                    "plan": planned.plan,
                    "checks": checks,
                });
                println!("{}", serde_json::to_string_pretty(&value).unwrap_or_default());
            } else {
                let f = &planned.facts;
                println!("kernel        {}", f.kernel_release);
                println!(
                    "distribution  {}",
                    if f.os.pretty_name.is_empty() {
                        &f.os.id
                    } else {
                        &f.os.pretty_name
                    }
                );
                println!("NVIDIA GPUs   {} on the PCI bus", f.gpus.len());
                let loaded = f.loaded.as_ref().map_or("none".to_string(), |l| {
                    format!("{} ({})", l.version.as_deref().unwrap_or("?"), l.modules.join(", "))
                });
                println!("loaded        {loaded}");
                println!("nouveau       {}", if f.nouveau { "loaded" } else { "not loaded" });
                println!(
                    "headers       {}",
                    f.headers
                        .as_ref()
                        .map_or("not installed".to_string(), |h| h.display().to_string())
                );
                println!("secure boot   {:?}", f.secure_boot);
                println!("\nplan: {}", gpu_node_agent::driver::plan::describe(&planned.plan));
                println!();
                for c in &checks {
                    println!("{} {:<10} {}", if c.ok { "ok  " } else { "FAIL" }, c.name, c.message);
                }
            }
            ExitCode::SUCCESS
        }
        DriverCommand::Install => {
            if let Some(wait) = &planned.plan.wait {
                eprintln!("gpu-node-agent: driver: {wait}; nothing changed");
                return Exit::TryLater.into();
            }
            match driver_stage::apply(config, root, &planned, None) {
                Ok(applied) => {
                    if applied.done.is_empty() {
                        println!("{}: nothing to do", planned.plan.summary);
                    }
                    for line in &applied.done {
                        println!("{line}");
                    }
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: driver: {e}");
                    return ExitCode::FAILURE;
                }
            }
            let facts = match gpu_node_agent::driver::observe::observe(root) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("gpu-node-agent: driver: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if facts.gpus.is_empty() {
                return ExitCode::SUCCESS;
            }
            let checks = driver_stage::validate_now(config, &facts, nvml_view(facts.gpus.len()));
            match gpu_node_agent::driver::validate::summary(&checks) {
                Ok(line) => {
                    println!("{line}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: driver validation failed: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn runtime_command(config: &Config, root: &HostRoot, command: RuntimeCommand) -> ExitCode {
    logging::init(&config.log);
    let runner = Runner::new(root);
    let (no_restart, dry_run, unconfigure) = match command {
        RuntimeCommand::Configure { no_restart, dry_run } => (no_restart, dry_run, false),
        RuntimeCommand::Unconfigure { no_restart } => (no_restart, false, true),
    };
    if !dry_run {
        match runtime_stage::recover(config, root) {
            Ok(Some(note)) => println!("{note}"),
            Ok(None) => {}
            Err(e) => {
                eprintln!("gpu-node-agent: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let planned = runtime_stage::observe(config, root, &runner).and_then(|o| {
        if unconfigure {
            runtime_stage::plan_unconfigure(&o, &config.runtime)
        } else {
            runtime_stage::plan(&o, &config.runtime)
        }
    });
    let plan = match planned {
        Ok(p) => p,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    for remark in plan.remarks() {
        println!("{remark}");
    }
    let failed_plans: Vec<String> = plan
        .engines
        .iter()
        .filter_map(|e| e.error.as_ref().map(|m| format!("{}: {m}", e.engine.as_str())))
        .collect();
    if plan.is_empty() {
        match &plan.note {
            Some(note) => println!("{note}"),
            None if failed_plans.is_empty() => println!("{}: already configured, nothing to do", plan.summary()),
            None => {}
        }
        for failure in &failed_plans {
            eprintln!("gpu-node-agent: {failure}");
        }
        return if failed_plans.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    if dry_run {
        print!("{}", runtime_stage::diff(&plan));
        return ExitCode::SUCCESS;
    }
    let opts = runtime_stage::ApplyOptions {
        restart: config.runtime.restart && !no_restart && root.is_real(),
    };
    let applied = runtime_stage::apply_all(&plan, config, root, &runner, &opts);
    for f in &applied.files {
        println!("{} {}", if unconfigure { "restored" } else { "wrote" }, f.display());
    }
    if applied.restarted.is_empty() {
        println!("restarted nothing");
    } else {
        println!("restarted {}", applied.restarted.join(", "));
    }
    for failure in &applied.failures {
        eprintln!("gpu-node-agent: {}", failure.error);
    }
    if applied.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn cdi_generate(config: &Config, root: &HostRoot, output: Option<&std::path::Path>) -> ExitCode {
    logging::init(&config.log);
    let gpus = match Gpus::open(&agent::nvml_library(config, root)) {
        Ok(gpus) => gpus,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return Exit::NoNvml.into();
        }
    };
    let inventory = match gpus.inventory(&root.join("/sys")) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return Exit::NoNvml.into();
        }
    };
    let nodes = gpu_node_agent::plugin::devnodes::DeviceNodes::gather(
        &root.join(&config.device_plugin.dev_root),
        &root.join("/proc"),
    );
    let result = match output {
        Some(p) if p == std::path::Path::new("-") => {
            runtime_stage::cdi_spec(config, root, &inventory, &nodes).map(|text| print!("{text}"))
        }
        Some(p) => runtime_stage::cdi_spec(config, root, &inventory, &nodes).and_then(|text| {
            gpu_node_agent::host::write_atomic(p, text.as_bytes(), 0o644)
                .map(|()| println!("wrote {}", p.display()))
                .map_err(Into::into)
        }),
        None => runtime_stage::write_cdi(config, root, &inventory, &nodes).map(|written| {
            let path = runtime_stage::cdi_path(config);
            if written {
                println!("wrote {}", path.display());
            } else {
                println!("{} is up to date", path.display());
            }
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

fn mig(config: &Config, root: &HostRoot, command: MigCommand) -> ExitCode {
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
    let gpus = match Gpus::open(&agent::nvml_library(config, root)) {
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
            let reset = |uuid: &str| gpu_node_agent::host::reset_gpu(&smi, uuid);
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

fn status(config: &Config, root: &HostRoot, json: bool) -> ExitCode {
    let path = root.join(&config.agent.run_dir).join(STATUS_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!(
                "gpu-node-agent: no status at {} ({e}): is the agent running? (systemctl status gpu-node-agent)",
                path.display()
            );
            return Exit::NotRunning.into();
        }
    };
    match gpu_node_agent::status::report(&text, root.path(), json, now_unix()) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "gpu-node-agent: {} is not a status file this version understands: {e}",
                path.display()
            );
            ExitCode::FAILURE
        }
    }
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
