//! Build helper for the packages (not shipped in them): writes the man pages and the shell
//! completions generated from the clap definitions in `gpu_node_agent::cli`, so they always
//! match the binary's `--help`.
//!
//! ```text
//! gna-gen man DIR           gpu-node-agent.1 and one page per subcommand (gpu-node-agent-run.1, ...)
//! gna-gen completions DIR   gpu-node-agent.bash, _gpu-node-agent (zsh), gpu-node-agent.fish
//! ```
//!
//! `scripts/package` runs it into `target/assets/`. The page date is taken from
//! `SOURCE_DATE_EPOCH` when set (reproducible builds), and left empty otherwise.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::CommandFactory;
use clap_complete::Shell;
use clap_mangen::Man;
use clap_mangen::roff::{Roff, bold, italic, roman};

use gpu_node_agent::cli::Cli;
use gpu_node_agent::exit::Exit;

const BIN: &str = "gpu-node-agent";
/// Footer of every page (clap_mangen would put the subcommand's name there).
const SOURCE: &str = concat!("gpu-node-agent ", env!("CARGO_PKG_VERSION"));
const MANUAL: &str = "gpu-node-agent manual";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.as_slice() {
        [what, dir] if what == "man" => man(Path::new(dir)),
        [what, dir] if what == "completions" => completions(Path::new(dir)),
        _ => {
            eprintln!("usage: gna-gen man DIR | gna-gen completions DIR");
            return Exit::Usage.into();
        }
    };
    match result {
        Ok(files) => {
            for file in files {
                println!("{}", file.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gna-gen: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The main page (clap's sections plus exit status, files, environment and see also) and one
/// page per visible subcommand at every level.
fn man(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let date = source_date();
    // NAME wants one line: a short about, with clap's (long) about as the DESCRIPTION.
    let cli = Cli::command();
    let long = cli.get_long_about().or(cli.get_about()).cloned().unwrap_or_default();
    let mut cmd = cli
        .about("GPU node agent: NVIDIA driver, container runtimes, MIG and device plugin for the kubelet")
        .long_about(long)
        .disable_help_subcommand(true);
    cmd.build();
    let mut written = Vec::new();

    let page = Man::new(cmd.clone()).date(&date).source(SOURCE).manual(MANUAL);
    let mut main = Vec::new();
    page.render(&mut main)?;
    let mut text = String::from_utf8(main).map_err(std::io::Error::other)?;
    // Exit status, files, environment, see also: before VERSION, without a second copy of the
    // apostrophe preamble that every roff rendering starts with.
    let extra: String = extra_sections()
        .render()
        .lines()
        .skip_while(|l| l.starts_with(".ie \\n(.g") || l.starts_with(".el .ds Aq"))
        .map(|l| format!("{l}\n"))
        .collect();
    match text.find("\n.SH VERSION\n") {
        Some(i) => text.insert_str(i + 1, &extra),
        None => text.push_str(&extra),
    }
    let path = dir.join(page.get_filename());
    std::fs::write(&path, text)?;
    written.push(path);

    fn sub_pages(cmd: &clap::Command, dir: &Path, date: &str, written: &mut Vec<PathBuf>) -> std::io::Result<()> {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            let page = Man::new(sub.clone()).date(date).source(SOURCE).manual(MANUAL);
            let path = dir.join(page.get_filename());
            let mut file = std::fs::File::create(&path)?;
            page.render(&mut file)?;
            file.flush()?;
            written.push(path);
            sub_pages(sub, dir, date, written)?;
        }
        Ok(())
    }
    sub_pages(&cmd, dir, &date, &mut written)?;
    Ok(written)
}

/// What `--help` does not say: exit codes, files, environment (README.md is the long form).
fn extra_sections() -> Roff {
    let mut roff = Roff::default();
    roff.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in [
        ("0", "success"),
        (
            "1",
            "a stage failed (or MIG is still pending after run --once), or an unexpected error",
        ),
        ("3", "status: no status file (the agent is not running)"),
        (
            "64",
            "invalid configuration; nothing was changed (systemd does not restart the agent for it)",
        ),
        ("69", "NVML could not be loaded or initialised"),
        (
            "75",
            "mig apply, driver install: GPU work is running, nothing was changed; try again later",
        ),
    ] {
        roff.control("TP", []);
        roff.text([bold(code)]);
        roff.text([roman(meaning)]);
    }
    roff.control("SH", ["FILES"]);
    for (path, meaning) in [
        (
            "/etc/gpu-node-agent/config.toml",
            "the main config file; every key is documented there with its default",
        ),
        (
            "/etc/gpu-node-agent/config.d/*.toml",
            "drop-ins, read in name order after config.toml; a later file overrides single keys",
        ),
        (
            "/run/gpu-node-agent/status.json",
            "the running agent's status, as shown by the status command",
        ),
        (
            "/var/lib/gpu-node-agent/",
            "state: driver cache, backups of the files the agent changed, journal",
        ),
        (
            "/lib/systemd/system/gpu-node-agent.service",
            "the systemd unit (/usr/lib/systemd/system on RPM systems)",
        ),
        (
            "/usr/share/doc/gpu-node-agent/",
            "README with the device plugin, health, MIG and cloud-init details",
        ),
    ] {
        roff.control("TP", []);
        roff.text([italic(path)]);
        roff.text([roman(meaning)]);
    }
    roff.control("SH", ["ENVIRONMENT"]);
    for (var, meaning) in [
        ("RUST_LOG", "overrides log.level (tracing env-filter syntax)"),
        ("KUBECONFIG", "kubeconfig used when kubernetes.kubeconfig is not set"),
        (
            "NODE_NAME",
            "the Node name when kubernetes.node_name is not set (default: the hostname)",
        ),
    ] {
        roff.control("TP", []);
        roff.text([bold(var)]);
        roff.text([roman(meaning)]);
    }
    roff.control("SH", ["SEE ALSO"]);
    roff.text([
        bold("systemctl"),
        roman("(1), "),
        bold("journalctl"),
        roman("(1), "),
        bold("nvidia-smi"),
        roman("(1), "),
        bold("kubelet"),
        roman("(1)"),
    ]);
    roff
}

/// bash, zsh and fish completions under the names the packages install them as (renamed there).
fn completions(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = Cli::command();
    [Shell::Bash, Shell::Zsh, Shell::Fish]
        .into_iter()
        .map(|shell| clap_complete::generate_to(shell, &mut cmd, BIN, dir))
        .collect()
}

/// `SOURCE_DATE_EPOCH` as YYYY-MM-DD (UTC), or empty.
fn source_date() -> String {
    let Some(secs) = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
    else {
        return String::new();
    };
    date_of(secs)
}

/// Unix seconds as YYYY-MM-DD (UTC).
fn date_of(secs: u64) -> String {
    let time = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    gpu_node_agent::kube::format_rfc3339(time).chars().take(10).collect()
}

#[cfg(test)]
mod tests {
    use super::date_of;

    #[test]
    fn dates() {
        assert_eq!(date_of(0), "1970-01-01");
        assert_eq!(date_of(19_723 * 86_400), "2024-01-01");
        assert_eq!(date_of(11_016 * 86_400 + 86_399), "2000-02-29");
    }
}
