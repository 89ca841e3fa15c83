//! Command-line interface (clap). Parsing only; `main.rs` runs the commands.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// One host agent that replaces the NVIDIA GPU Operator on a Kubernetes node: it reads the desired
/// state from its Node's labels, configures the container runtimes and writes the CDI spec,
/// applies MIG layouts, advertises the GPUs to the kubelet (device plugin), and reports state and
/// GPU feature labels back.
#[derive(Debug, Parser)]
#[command(name = "gpu-node-agent", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Main config file; drop-ins are read from `config.d/` beside it. Default:
    /// /etc/gpu-node-agent/config.toml under --root (optional there; required when given here).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Prefix for every host path the agent reads or writes (building a node image, tests).
    #[arg(long, global = true, value_name = "DIR", default_value = "/")]
    pub root: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent: reconcile every stage, serve the kubelet device plugin, keep it in step.
    Run {
        /// Reconcile every stage once and exit (for cloud-init, before the kubelet joins): the
        /// driver is installed, the runtimes configured, the MIG layout the labels ask for
        /// applied, then validated. 0 when every stage succeeded, 1 when one failed, 75 when one
        /// waits (GPU work holds a MIG or driver change), 64 for an invalid config.
        #[arg(long)]
        once: bool,
    },
    /// Print what `run` would do now, changing nothing: from the config, the desired labels (Node,
    /// labels file or the ones last seen) and the host, every stage's plan: driver, container
    /// runtime edits as a unified diff, MIG operations, CDI spec, resources and Node labels.
    Plan {
        /// Print JSON instead of text (every stage).
        #[arg(long)]
        json: bool,
        /// Plan this MIG layout instead of the one the labels ask for.
        #[arg(long, value_name = "LAYOUT")]
        mig_layout: Option<String>,
    },
    /// Show the running agent's status: stages, GPUs and their health, resources advertised.
    /// Exit 0 while the agent runs (or for a `run --once` report), 3 when it is not running.
    Status {
        /// Print the raw status.json.
        #[arg(long)]
        json: bool,
    },
    /// Config file commands.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// MIG layouts: apply or check a named layout, export the current state, import mig-parted.
    Mig {
        #[command(subcommand)]
        command: MigCommand,
    },
    /// The NVIDIA kernel driver for the running kernel ([driver]).
    Driver {
        #[command(subcommand)]
        command: DriverCommand,
    },
    /// Container runtimes: put the nvidia runtime into containerd, docker and CRI-O, or take it
    /// out again.
    Runtime {
        #[command(subcommand)]
        command: RuntimeCommand,
    },
    /// CDI: write the spec for the node's GPUs.
    Cdi {
        #[command(subcommand)]
        command: CdiCommand,
    },
    /// Validation checks by themselves.
    Validate {
        #[command(subcommand)]
        command: ValidateCommand,
    },
    /// Migrating from NVIDIA's GPU Operator: set `nvidia.com/gpu.deploy.<operand>=false` on this
    /// Node for each operand the agent replaces with its config (the Operator then removes them
    /// from the node; a running agent takes over each once it has gone), keeping each label's
    /// previous value under [agent] state_dir. Prints what it set and which operands still run.
    Migrate {
        /// Put the recorded deploy labels back as they were (unset ones removed), for handing
        /// the node back to the Operator: stop the agent first.
        #[arg(long)]
        undo: bool,
    },
    /// Print the version.
    Version,
}

#[derive(Debug, Subcommand)]
pub enum ValidateCommand {
    /// Load libcuda from the driver root, and on every GPU allocate memory, run a tiny kernel and
    /// check its result (what the validation stage runs in a child process). Exit 0: passed or
    /// no libcuda (not available); 1: failed.
    Cuda {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Where the driver is installed (default: [device_plugin] driver_root).
        #[arg(long, value_name = "DIR")]
        driver_root: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum DriverCommand {
    /// What the host has (kernel, distribution, NVIDIA PCI devices, loaded modules, headers,
    /// Secure Boot), what the driver stage would do, and the validation checks. Changes nothing.
    /// Exit 1 when a check failed.
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run the driver stage once: install, build or load the driver [driver] asks for, then
    /// validate. Exit 0: done or already so; 75: GPU work running, nothing changed; 1: failed.
    Install,
}

#[derive(Debug, Subcommand)]
pub enum RuntimeCommand {
    /// Configure every selected engine as the runtime stage does ([runtime]): backups first,
    /// containerd's own check, a restart of each engine whose files changed (never under --root
    /// other than /), and the previous files put back if it does not come back. Exit 0: done or
    /// already so; 1: failed (nothing left half-done).
    Configure {
        /// Write the files but restart nothing.
        #[arg(long)]
        no_restart: bool,
        /// Print the unified diff of what would change, and change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Take the nvidia runtime out again: files the agent wrote and nobody edited since get
    /// back exactly what was there before; files edited since lose only the agent's entries; the
    /// agent's drop-ins and CDI specs go, and the `/dev/char` links it made; its DRA slices are
    /// deleted and the GPU Operator's deploy labels a migration set are put back. Engines whose
    /// files changed are restarted. Removing the package runs it.
    Unconfigure {
        /// Write the files but restart nothing.
        #[arg(long)]
        no_restart: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CdiCommand {
    /// Write the CDI spec for the GPUs NVML reports to [cdi] dir (as the agent does at start and
    /// after every MIG change), and the specs of the enabled GDS, MOFED, GDRCopy and IMEX
    /// injections whose device nodes the host has (removing those that no longer apply).
    Generate {
        /// Write the GPU spec here instead (a real path, not under --root); `-` prints it.
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Run a CDI hook, as gpu-node-agent-cdi-hook does: for specs written by earlier versions
    /// (the agent's spec now names gpu-node-agent-cdi-hook, a statically linked program).
    /// Container runtimes run hooks with the container's OCI state on standard input. Needs no
    /// config and no NVIDIA Container Toolkit. Exit 0: done; 1: failed (the runtime then refuses
    /// to start the container).
    Hook {
        #[command(subcommand)]
        hook: HookCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum HookCommand {
    /// Create symlinks in the container, such as the driver libraries' soname links.
    CreateSymlinks {
        /// `<target>::<path in the container>`, e.g. `libcuda.so.550.54.15::/usr/lib64/libcuda.so.1`.
        #[arg(long = "link", value_name = "TARGET::PATH")]
        links: Vec<String>,
    },
    /// Add these folders to the container's linker cache: the host's statically linked ldconfig
    /// runs in a sandbox pivoted into the container's root (nothing of the image is executed).
    UpdateLdcache {
        /// A folder with driver libraries, in the container.
        #[arg(long = "folder", value_name = "DIR")]
        folders: Vec<PathBuf>,
        /// The host's ldconfig to run, a root-owned static program (default: the first usable of
        /// /sbin/ldconfig.real, /sbin/ldconfig, /usr/sbin/ldconfig.real, /usr/sbin/ldconfig).
        #[arg(long, value_name = "PATH")]
        ldconfig_path: Option<PathBuf>,
    },
    /// Use the image's CUDA forward-compatibility libraries (/usr/local/cuda/compat) when they
    /// are newer than the host driver.
    EnableCudaCompat {
        /// The host driver's version, e.g. 550.54.15.
        #[arg(long, value_name = "VERSION")]
        host_driver_version: String,
    },
    /// Show the container ModifyDeviceFiles: 0 in /proc/driver/nvidia/params, so CUDA does not
    /// try to create device nodes.
    DisableDeviceNodeModification,
}

#[derive(Debug, Subcommand)]
pub enum MigCommand {
    /// Bring the GPUs to a layout of the config ([mig.layouts] or a built-in one). Refuses a
    /// layout that cannot fit before changing anything, and GPUs with processes on them.
    /// Exit 0: done or already so; 75: GPU work running, nothing changed; 1: failed.
    Apply {
        /// Layout name, e.g. all-1g.5gb, all-balanced, or one of [mig.layouts].
        layout: String,
    },
    /// Check whether the GPUs match a layout, changing nothing: exit 0 if they do, 1 with what
    /// would change if not.
    Assert { layout: String },
    /// Print the current MIG state as a layout ([[mig.layouts.current]] TOML).
    Export,
    /// Read a mig-parted `version: v1` YAML file (or the ConfigMap holding one, as `kubectl get
    /// configmap -o yaml` prints it) and print its layouts as config TOML, for a drop-in such as
    /// /etc/gpu-node-agent/config.d/50-mig.toml.
    Import {
        /// The mig-parted file or ConfigMap (a host path, not under --root).
        file: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the config files and print the effective config; exit 64 if invalid.
    Check,
}
