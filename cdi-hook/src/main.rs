//! `gpu-node-agent-cdi-hook <hook> [options] < OCI state`: the CDI hooks of gpu-node-agent's
//! spec (see the library's documentation for what each does and the rules it keeps).
//!
//! Reads no environment variable; the whole run is bounded by [`cdi_hook::HOOK_TIMEOUT`]
//! (`SIGALRM`, whose handler writes one line and exits 1). Exit 0: done; 1: failed (the runtime
//! then refuses the container); 2: usage.

use std::process::ExitCode;

extern "C" fn timed_out(_: libc::c_int) {
    const MESSAGE: &[u8] = b"gpu-node-agent-cdi-hook: did not finish in time; the container is refused\n";
    // SAFETY: write and _exit are async-signal-safe.
    unsafe {
        libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
        libc::_exit(1);
    }
}

fn main() -> ExitCode {
    // SAFETY: installs a handler that only calls async-signal-safe functions, then arms the
    // alarm; the process has one thread.
    unsafe {
        libc::signal(libc::SIGALRM, timed_out as *const () as libc::sighandler_t);
        libc::alarm(cdi_hook::HOOK_TIMEOUT.as_secs() as libc::c_uint);
    }
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == "--help" || a == "-h") {
        println!("{}", cdi_hook::USAGE);
        return ExitCode::SUCCESS;
    }
    if args.first().is_some_and(|a| a == "--version") {
        println!("{} {}", cdi_hook::PROGRAM, env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let hook = match cdi_hook::parse_args(&args) {
        Ok(hook) => hook,
        Err(e) => {
            eprintln!("{}: {e}", cdi_hook::PROGRAM);
            return ExitCode::from(2);
        }
    };
    match cdi_hook::run(&hook, std::io::stdin().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{} {}: {e}", cdi_hook::PROGRAM, hook.name());
            ExitCode::FAILURE
        }
    }
}
