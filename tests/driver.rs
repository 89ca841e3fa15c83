//! The driver stage against the real binary under a temp root. CI cannot load kernel modules,
//! so `modprobe`, `insmod`, `rmmod`, `apt-get` and `nvidia-smi` are stand-ins under the root
//! that log their argv (and environment) and do to sysfs what the real ones do to the kernel:
//! the tests check the exact commands and their order. The `.run` download goes to a local
//! HTTP server; the kbuild of its modules is real (`tests/kbuild.rs` covers kbuild itself).

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::Node;
use gpu_node_agent::status::{StageId, StageState};

const VERSION: &str = "550.54.15";
const UBUNTU: &str =
    "NAME=\"Ubuntu\"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID=\"22.04\"\nPRETTY_NAME=\"Ubuntu 22.04.4 LTS\"\n";
const KERNEL: &str = "6.8.0-1015-aws";

/// A node whose kernel has no NVIDIA module loaded yet, with logging stand-ins for the
/// programs the driver stage runs.
fn bare_node(config: &str) -> Node {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 2), config);
    for m in ["nvidia", "nvidia_uvm", "nvidia_modeset"] {
        let _ = fs::remove_dir_all(node.root.join("sys/module").join(m));
    }
    write(&node.root, "etc/os-release", UBUNTU);
    write(&node.root, "proc/sys/kernel/osrelease", &format!("{KERNEL}\n"));
    let log = log_path(&node);
    let sys = node.root.join("sys/module");
    // `modprobe M` / `insmod M.ko` appear in /sys/module as the kernel shows them; `-r` removes.
    let load = format!(
        "m=$(basename \"$1\" .ko | tr - _); mkdir -p \"{sys}/$m\"; [ \"$m\" = nvidia ] && echo {VERSION} > \"{sys}/nvidia/version\"; exit 0",
        sys = sys.display()
    );
    stand_in(
        &node,
        "/usr/sbin/modprobe",
        &log,
        &format!(
            "if [ \"$1\" = -r ]; then rm -rf \"{}/$2\"; exit 0; fi; {load}",
            sys.display()
        ),
    );
    stand_in(&node, "/usr/sbin/insmod", &log, &load);
    stand_in(
        &node,
        "/usr/sbin/rmmod",
        &log,
        &format!("rm -rf \"{}/$1\"", sys.display()),
    );
    stand_in(
        &node,
        "/usr/bin/apt-get",
        &log,
        "echo \"  DEBIAN_FRONTEND=$DEBIAN_FRONTEND\" >> \"$LOG\"",
    );
    stand_in(&node, "/usr/bin/nvidia-smi", &log, "");
    node
}

fn write(root: &Path, rel: &str, text: &str) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(path, text).expect("write");
}

fn log_path(node: &Node) -> PathBuf {
    node.tmp.path().join("commands.log")
}

/// An executable at `host_path` under the root that appends its argv (program name without the
/// directory) to `log`, then runs `body`.
fn stand_in(node: &Node, host_path: &str, log: &Path, body: &str) {
    let name = Path::new(host_path)
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let script = format!(
        "#!/bin/sh\nLOG=\"{}\"\necho \"{name} $*\" >> \"$LOG\"\n{body}\n",
        log.display()
    );
    let path = node.root.join(host_path.trim_start_matches('/'));
    fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
    fs::write(&path, script).expect("stand-in");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
}

fn commands(node: &Node) -> Vec<String> {
    fs::read_to_string(log_path(node))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every file, link and directory under `root` (relative path → content, link target or
/// `dir`), to tell what a run changed.
fn snapshot(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            let meta = fs::symlink_metadata(&path).expect("metadata");
            // The one-writer lock a command takes is the agent's, not a change to the node.
            if rel == "var/lib/gpu-node-agent/lock" {
                continue;
            }
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&path).expect("link");
                out.insert(rel, format!("-> {}", target.display()));
            } else if meta.is_dir() {
                out.insert(rel, "dir".into());
                walk(root, &path, out);
            } else {
                let bytes = fs::read(&path).unwrap_or_default();
                out.insert(rel, format!("{:o} {}", meta.permissions().mode(), sha256_hex(&bytes)));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The agent's download area, relative to the root: the only place a failed download may leave
/// a trace.
const DOWNLOAD_AREA: &str = "var/lib/gpu-node-agent/driver/downloads";

/// What differs between two snapshots, except in the download area (and its parent directories,
/// created for it).
fn changed_outside_downloads(before: &BTreeMap<String, String>, after: &BTreeMap<String, String>) -> Vec<String> {
    let keys: std::collections::BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    keys.into_iter()
        .filter(|k| before.get(*k) != after.get(*k))
        .filter(|k| !k.starts_with(DOWNLOAD_AREA))
        .filter(|k| {
            let created_parent = DOWNLOAD_AREA.starts_with(&format!("{k}/"))
                && before.get(*k).is_none()
                && after.get(*k).is_some_and(|v| v == "dir");
            !created_parent
        })
        .map(|k| format!("{k}: {:?} -> {:?}", before.get(k), after.get(k)))
        .collect()
}

/// A `systemctl` stand-in: `is-active --quiet UNIT` answers from marker files in `units`
/// (present: active), `stop` removes the marker, `start` creates it.
fn systemctl(node: &Node, units: &Path) {
    stand_in(
        node,
        "/usr/bin/systemctl",
        &log_path(node),
        &format!(
            "d=\"{}\"\ncase \"$1\" in\n  is-active) [ -e \"$d/$3\" ]; exit $? ;;\n  stop) rm -f \"$d/$2\" ;;\n  start) mkdir -p \"$d\"; touch \"$d/$2\" ;;\nesac\nexit 0",
            units.display()
        ),
    );
}

/// Unit files for nvidia-persistenced and the fabric manager under the root, both active.
fn nvidia_units(node: &Node) -> PathBuf {
    let active = node.tmp.path().join("active-units");
    fs::create_dir_all(&active).expect("mkdir");
    for unit in ["nvidia-persistenced.service", "nvidia-fabricmanager.service"] {
        write(&node.root, &format!("lib/systemd/system/{unit}"), "[Service]\n");
        fs::write(active.join(unit), "").expect("active");
    }
    systemctl(node, &active);
    active
}

/// `bare_node` with everything a driver change would touch: driver 535 loaded (with
/// nvidia_drm), nouveau loaded, no kernel headers, nvidia-persistenced and the fabric manager
/// active, no modprobe.d file yet.
fn node_with_everything_to_change(config: &str) -> Node {
    node_with_535_loaded(config, &["nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nouveau"])
}

/// A node with the 535 driver loaded, `modules` loaded beside it, and nvidia-persistenced and
/// the fabric manager active.
fn node_with_535_loaded(config: &str, modules: &[&str]) -> Node {
    let node = bare_node(config);
    write(&node.root, "sys/module/nvidia/version", "535.161.08\n");
    for m in modules {
        fs::create_dir_all(node.root.join("sys/module").join(m)).expect("module");
    }
    nvidia_units(&node);
    node
}

#[test]
fn package_flow_installs_with_apt_then_loads_in_order_and_validates() {
    let node = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let apt = "apt-get -o DPkg::Lock::Timeout=600";
    assert_eq!(
        commands(&node),
        [
            format!("{apt} -q update"),
            "  DEBIAN_FRONTEND=noninteractive".to_string(),
            format!(
                "{apt} -y -q --no-install-recommends install linux-modules-nvidia-550-server-{KERNEL} \
                 nvidia-headless-no-dkms-550-server nvidia-utils-550-server"
            ),
            "  DEBIAN_FRONTEND=noninteractive".to_string(),
            "modprobe nvidia".to_string(),
            "modprobe nvidia-uvm".to_string(),
            "modprobe nvidia-modeset".to_string(),
            "nvidia-smi -pm 1".to_string(),
        ]
    );
    let conf = fs::read_to_string(node.root.join("etc/modprobe.d/gpu-node-agent.conf")).expect("modprobe conf");
    assert!(conf.contains("blacklist nouveau"), "{conf}");
    assert!(text(&out).contains("driver 550.54.15 on 2 GPU(s)"), "{}", text(&out));

    // Loaded and validated: a second run changes nothing.
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("nothing to do"), "{}", text(&out));
    assert_eq!(commands(&node).len(), 8, "no command ran the second time");
}

/// A package install interrupted before (dpkg's updates dir not empty: what apt refuses to run
/// over) is finished with `dpkg --configure -a` before apt runs again.
#[test]
fn an_interrupted_dpkg_run_is_finished_before_apt_runs() {
    let node = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    let updates = node.root.join("var/lib/dpkg/updates");
    write(
        &node.root,
        "var/lib/dpkg/updates/0001",
        "Package: nvidia-utils-550-server\n",
    );
    stand_in(
        &node,
        "/usr/bin/dpkg",
        &log_path(&node),
        &format!("rm -f \"{}\"/*", updates.display()),
    );
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let ran = commands(&node);
    assert_eq!(ran.first().map(String::as_str), Some("dpkg --configure -a"), "{ran:?}");
    assert!(ran[1].starts_with("apt-get "), "{ran:?}");
    assert!(text(&out).contains("interrupted"), "{}", text(&out));

    // Finished: the next install does not run it again.
    let again = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    stand_in(&again, "/usr/bin/dpkg", &log_path(&again), "");
    assert_eq!(again.run(&["driver", "install"]).status.code(), Some(0));
    assert!(
        commands(&again).iter().all(|c| !c.starts_with("dpkg")),
        "{:?}",
        commands(&again)
    );
}

#[test]
fn an_upgrade_waits_for_gpu_work_then_unloads_in_dependency_order() {
    let node = bare_node("[driver]\nsource = \"package\"\nversion = \"550.54.15\"\n");
    write(&node.root, "sys/module/nvidia/version", "535.161.08\n");
    for m in ["nvidia_uvm", "nvidia_modeset", "nvidia_drm"] {
        fs::create_dir_all(node.root.join("sys/module").join(m)).expect("module");
    }
    node.set_injection("processes", &format!("{} 4242 1024\n", common::gpu_uuid(0)));
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(75), "{}", text(&out));
    assert!(text(&out).contains("1 GPU process(es) running"), "{}", text(&out));
    assert!(
        commands(&node).is_empty(),
        "nothing ran under GPU work: {:?}",
        commands(&node)
    );

    node.set_injection("processes", "");
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let ran = commands(&node);
    let unloads: Vec<&String> = ran.iter().filter(|c| c.starts_with("rmmod")).collect();
    assert_eq!(
        unloads,
        [
            "rmmod nvidia_drm",
            "rmmod nvidia_modeset",
            "rmmod nvidia_uvm",
            "rmmod nvidia"
        ],
        "{ran:?}"
    );
    let first_install = ran.iter().position(|c| c.contains(" install ")).expect("install");
    let last_unload = ran.iter().rposition(|c| c.starts_with("rmmod")).expect("unload");
    assert!(last_unload < first_install, "unload before install: {ran:?}");
}

#[test]
fn an_unknown_distribution_is_refused_and_nothing_changes() {
    let node = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    write(&node.root, "etc/os-release", "ID=gentoo\nNAME=Gentoo\n");
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("unknown distribution \"gentoo\"") && text(&out).contains("nothing was changed"),
        "{}",
        text(&out)
    );
    assert!(commands(&node).is_empty());
    assert!(!node.root.join("etc/modprobe.d/gpu-node-agent.conf").exists());
}

#[test]
fn an_immutable_host_refuses_sources_that_write_usr_and_changes_nothing() {
    // Fedora CoreOS (rpm-ostree: /run/ostree-booted) and Flatcar: apt/dnf and nvidia-installer
    // would write /usr, which is read-only there.
    let hosts = [
        (
            "run/ostree-booted",
            "ID=fedora\nVARIANT_ID=coreos\nNAME=\"Fedora Linux\"\n",
            "rpm-ostree",
        ),
        (
            "",
            "ID=flatcar\nID_LIKE=coreos\nNAME=\"Flatcar Container Linux by Kinvolk\"\n",
            "Flatcar",
        ),
    ];
    for (marker, os_release, named) in hosts {
        for source in ["package", "runfile"] {
            let node = bare_node(&format!(
                "[driver]\nsource = \"{source}\"\nversion = \"{VERSION}\"\nrunfile_sha256 = \"{}\"\n",
                "0".repeat(64)
            ));
            write(&node.root, "etc/os-release", os_release);
            if !marker.is_empty() {
                write(&node.root, marker, "");
            }
            let before = snapshot(&node.root);
            let out = node.run(&["driver", "install"]);
            let t = text(&out);
            assert_eq!(out.status.code(), Some(1), "{named} {source}: {t}");
            assert!(
                t.contains(named) && t.contains(&format!("source = \"{source}\"")) && t.contains("nothing was changed"),
                "{named} {source}: {t}"
            );
            assert!(commands(&node).is_empty(), "{named} {source}: {:?}", commands(&node));
            assert_eq!(
                changed_outside_downloads(&before, &snapshot(&node.root)),
                Vec::<String>::new(),
                "{named} {source}"
            );
        }
    }
}

#[test]
fn a_node_without_nvidia_pci_devices_does_nothing() {
    let node = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    fs::remove_dir_all(node.root.join("sys/bus/pci")).expect("no PCI");
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("no NVIDIA GPU on the PCI bus: nothing to do"),
        "{}",
        text(&out)
    );
    assert!(commands(&node).is_empty());
    assert!(!node.root.join("etc/modprobe.d/gpu-node-agent.conf").exists());
}

/// A one-file HTTP server on loopback that counts its requests.
struct Server {
    url: String,
    requests: Arc<AtomicUsize>,
}

fn serve(body: Vec<u8>) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!(
        "http://{}/NVIDIA-Linux-x86_64-{VERSION}.run",
        listener.local_addr().expect("addr")
    );
    let requests = Arc::new(AtomicUsize::new(0));
    let count = requests.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            count.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    Server { url, requests }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A `.run` stand-in: a shell script that, run with `-x --target DIR`, extracts a kbuild tree of
/// three small modules named like the driver's into `DIR/kernel`, and leaves a marker showing it
/// ran.
fn runfile(marker: &Path) -> Vec<u8> {
    let module = |name: &str| {
        format!(
            "cat > \"$dir/kernel/{name}.c\" <<'EOF'\n#include <linux/module.h>\nstatic int __init m_init(void) {{ return 0; }}\nstatic void __exit m_exit(void) {{}}\nmodule_init(m_init);\nmodule_exit(m_exit);\nMODULE_LICENSE(\"GPL\");\nMODULE_DESCRIPTION(\"stand-in for {name}\");\nEOF\n"
        )
    };
    format!(
        "#!/bin/sh\n[ \"$1\" = -x ] && [ \"$2\" = --target ] || exit 2\ndir=\"$3\"\necho ran >> \"{}\"\nmkdir -p \"$dir/kernel\"\necho 'obj-m += nvidia.o nvidia-uvm.o nvidia-modeset.o' > \"$dir/kernel/Makefile\"\n{}{}{}",
        marker.display(),
        module("nvidia"),
        module("nvidia-uvm"),
        module("nvidia-modeset"),
    )
    .into_bytes()
}

#[test]
fn a_runfile_with_the_wrong_checksum_is_never_run() {
    let probe = tempfile::tempdir().expect("tmp");
    let marker = probe.path().join("ran");
    let server = serve(runfile(&marker));
    let config = format!(
        "[driver]\nsource = \"runfile\"\nversion = \"{VERSION}\"\nrunfile_url = \"{}\"\nrunfile_sha256 = \"{}\"\n",
        server.url.replace(VERSION, "{version}").replace("x86_64", "{arch}"),
        "0".repeat(64)
    );
    // An upgrade with nouveau loaded, no headers and the driver's services running: everything
    // the stage would change once the .run is verified.
    let node = node_with_everything_to_change(&config);
    let said = install_fails_changing_nothing(&node, "no program ran (no unload, no apt-get, no systemctl stop)");
    assert!(said.contains("sha256"), "{said}");
    assert!(!marker.exists(), "the unverified .run file was executed");
    assert_eq!(server.requests.load(Ordering::SeqCst), 1);
    let downloads = node.root.join(DOWNLOAD_AREA);
    let left: Vec<_> = fs::read_dir(&downloads)
        .map(|d| d.flatten().collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "nothing unverified is kept: {left:?}");
}

/// `driver install` on `node`: asserted to fail (exit 1) having run no program (`no_program`
/// says which were expected not to) and changed nothing outside the download area; its output.
fn install_fails_changing_nothing(node: &Node, no_program: &str) -> String {
    let before = snapshot(&node.root);
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(commands(node), Vec::<String>::new(), "{no_program}");
    let changed = changed_outside_downloads(&before, &snapshot(&node.root));
    assert!(changed.is_empty(), "the host was changed: {changed:#?}");
    text(&out)
}

#[test]
fn no_network_gives_a_clear_message_and_changes_nothing() {
    // A port nothing listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let config = format!(
        "[driver]\nsource = \"runfile\"\nversion = \"{VERSION}\"\nrunfile_url = \"http://127.0.0.1:{port}/{{version}}.run\"\nrunfile_sha256 = \"{}\"\n",
        "a".repeat(64)
    );
    let node = node_with_everything_to_change(&config);
    let said = install_fails_changing_nothing(
        &node,
        "no program ran (no modprobe -r nouveau, no apt-get for the headers, no rmmod, no systemctl stop)",
    );
    assert!(said.contains(&format!("cannot reach 127.0.0.1:{port}")), "{said}");
}

#[test]
fn missing_headers_on_an_unknown_distribution_say_what_to_install_before_any_download() {
    let probe = tempfile::tempdir().expect("tmp");
    let server = serve(runfile(&probe.path().join("ran")));
    let config = format!(
        "[driver]\nsource = \"runfile\"\nversion = \"{VERSION}\"\nrunfile_url = \"{}\"\nrunfile_sha256 = \"{}\"\n",
        server.url,
        "b".repeat(64)
    );
    let node = bare_node(&config);
    write(&node.root, "etc/os-release", "ID=gentoo\n");
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("no kernel headers for the running kernel {KERNEL}"))
            && text(&out).contains(&format!("linux-headers-{KERNEL}")),
        "{}",
        text(&out)
    );
    assert_eq!(server.requests.load(Ordering::SeqCst), 0, "nothing downloaded");
    assert!(commands(&node).is_empty());
}

/// The kernel headers Debian's `linux-headers-amd64` installed (`scripts/deps`), made visible
/// under the node's root as `/lib/modules/<release>/build`, and that release as the node's
/// running kernel.
fn headers_in_root(node: &Node) -> String {
    let installed = gpu_node_agent::driver::build::installed_headers(&gpu_node_agent::host::HostRoot::new("/"));
    let Some((release, path)) = installed.into_iter().next() else {
        panic!("no kernel headers installed: run scripts/deps (apt-get install linux-headers-amd64 make kmod)");
    };
    // The agent resolves links inside its root, so the headers' top-level files are copied in;
    // their directories are links kbuild (which runs on this machine) follows to the real ones.
    let farm = node.root.join(format!("usr/src/linux-headers-{release}"));
    fs::create_dir_all(&farm).expect("mkdir headers");
    for entry in fs::read_dir(&path).expect("read headers").flatten() {
        let real = fs::canonicalize(entry.path()).expect("canonical headers entry");
        if real.is_dir() {
            std::os::unix::fs::symlink(real, farm.join(entry.file_name())).expect("link headers dir");
        } else {
            fs::copy(&real, farm.join(entry.file_name())).expect("copy headers file");
        }
    }
    let build = node.root.join(format!("lib/modules/{release}/build"));
    fs::create_dir_all(build.parent().expect("modules dir")).expect("mkdir modules");
    std::os::unix::fs::symlink(format!("/usr/src/linux-headers-{release}"), &build).expect("build link");
    write(&node.root, "proc/sys/kernel/osrelease", &format!("{release}\n"));
    // The node's own sh, make and modinfo.
    for (host, candidates) in [
        ("bin/sh", &["/bin/sh"][..]),
        ("usr/bin/make", &["/usr/bin/make"][..]),
        ("usr/sbin/modinfo", &["/usr/sbin/modinfo", "/sbin/modinfo"][..]),
    ] {
        let real = candidates.iter().find(|c| Path::new(c).exists()).unwrap_or_else(|| {
            panic!(
                "{} missing: run scripts/deps (apt-get install make kmod)",
                candidates.join(" or ")
            )
        });
        let link = node.root.join(host);
        fs::create_dir_all(link.parent().expect("dir")).expect("mkdir");
        std::os::unix::fs::symlink(real, link).expect("link program");
    }
    release
}

#[test]
fn a_verified_runfile_is_built_with_kbuild_cached_and_loaded_from_the_cache_after_a_reboot() {
    let probe = tempfile::tempdir().expect("tmp");
    let marker = probe.path().join("ran");
    let body = runfile(&marker);
    let sha = sha256_hex(&body);
    let server = serve(body);
    let config = format!(
        "[driver]\nsource = \"runfile\"\nversion = \"{VERSION}\"\nrunfile_url = \"{}\"\nrunfile_sha256 = \"{sha}\"\n\
         module_params = {{ nvidia = [\"NVreg_EnableGpuFirmware=0\"] }}\n",
        server.url
    );
    let node = bare_node(&config);
    let release = headers_in_root(&node);

    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("built the proprietary modules for {release} and cached them")),
        "{}",
        text(&out)
    );
    assert_eq!(server.requests.load(Ordering::SeqCst), 1);
    let insmods: Vec<String> = commands(&node)
        .into_iter()
        .filter(|c| c.starts_with("insmod"))
        .collect();
    assert_eq!(insmods.len(), 3, "{insmods:?}");
    assert!(
        insmods[0].ends_with("/nvidia.ko NVreg_EnableGpuFirmware=0") && insmods[1].ends_with("/nvidia-uvm.ko"),
        "load order and parameters: {insmods:?}"
    );
    assert!(
        insmods[0].contains("/var/lib/gpu-node-agent/driver/cache/"),
        "{insmods:?}"
    );

    // A reboot: the modules are gone from the kernel; the same kernel and driver load from the
    // cache with no download and no build.
    for m in ["nvidia", "nvidia_uvm", "nvidia_modeset"] {
        fs::remove_dir_all(node.root.join("sys/module").join(m)).expect("unload");
    }
    let status = node.run(&["driver", "status"]);
    assert!(text(&status).contains("from the module cache"), "{}", text(&status));
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(!text(&out).contains("built"), "{}", text(&out));
    assert_eq!(server.requests.load(Ordering::SeqCst), 1, "no second download");
    assert_eq!(
        fs::read_to_string(&marker).expect("marker").lines().count(),
        1,
        "the .run ran once"
    );
    let insmods = commands(&node).into_iter().filter(|c| c.starts_with("insmod")).count();
    assert_eq!(insmods, 6);
}

#[test]
fn run_once_puts_the_driver_first_and_reports_it_in_status() {
    let node = bare_node(&format!(
        "[kubernetes]\nenabled = false\n[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"
    ));
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let status = node.status();
    let names: Vec<&str> = status.stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["driver", "runtime", "mig", "device-plugin", "validation"]);
    let driver = common::stage(&status, StageId::Driver);
    assert_eq!(driver.state, StageState::Ok, "{driver:?}");
    assert!(
        driver
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("driver 550.54.15 on 2 GPU(s)")),
        "{driver:?}"
    );
    assert!(commands(&node).contains(&"modprobe nvidia".to_string()));

    // A failing install: exit 1, the stage says why, nothing after it ran.
    let broken = bare_node(&format!(
        "[kubernetes]\nenabled = false\n[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"
    ));
    stand_in(
        &broken,
        "/usr/bin/apt-get",
        &log_path(&broken),
        "echo 'E: Unable to locate package nvidia-utils-550-server' >&2; exit 100",
    );
    let out = broken.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let status = broken.status();
    let driver = common::stage(&status, StageId::Driver);
    assert_eq!(driver.state, StageState::Failed);
    assert!(
        driver
            .error
            .as_deref()
            .is_some_and(|e| e.contains("Unable to locate package")),
        "{driver:?}"
    );
}

#[test]
fn prebuilt_modules_are_verified_unpacked_into_the_cache_and_loaded() {
    let stage = tempfile::tempdir().expect("tmp");
    let dir = stage.path().join(format!("nvidia-{VERSION}"));
    fs::create_dir_all(&dir).expect("mkdir");
    for m in ["nvidia", "nvidia-uvm", "nvidia-modeset"] {
        fs::write(dir.join(format!("{m}.ko")), format!("prebuilt {m}")).expect("ko");
    }
    let tarball = stage.path().join("modules.tar.gz");
    let ok = std::process::Command::new("tar")
        .arg("-czf")
        .arg(&tarball)
        .arg("-C")
        .arg(stage.path())
        .arg(format!("nvidia-{VERSION}"))
        .status()
        .expect("tar");
    assert!(ok.success());
    let body = fs::read(&tarball).expect("tarball");
    let sha = sha256_hex(&body);
    let server = serve(body);
    let config = format!(
        "[driver]\nsource = \"prebuilt\"\nversion = \"{VERSION}\"\nprebuilt_url = \"{}/{{kernel}}/{{flavour}}.tar.gz\"\n\
         [driver.prebuilt_sha256]\n\"{KERNEL}\" = \"{sha}\"\n",
        server.url.rsplit_once('/').expect("url").0
    );
    let node = bare_node(&config);
    let tar = node.root.join("usr/bin/tar");
    std::os::unix::fs::symlink(
        if Path::new("/usr/bin/tar").exists() {
            "/usr/bin/tar"
        } else {
            "/bin/tar"
        },
        tar,
    )
    .expect("tar link");
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let insmods: Vec<String> = commands(&node)
        .into_iter()
        .filter(|c| c.starts_with("insmod"))
        .collect();
    assert_eq!(insmods.len(), 3, "{insmods:?}");
    assert!(
        insmods[0].contains("/driver/cache/") && insmods[0].ends_with("/nvidia.ko"),
        "{insmods:?}"
    );

    // Another kernel has no checksum: refused before any download.
    write(&node.root, "proc/sys/kernel/osrelease", "6.8.0-2000-aws\n");
    for m in ["nvidia", "nvidia_uvm", "nvidia_modeset"] {
        let _ = fs::remove_dir_all(node.root.join("sys/module").join(m));
    }
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("no [driver.prebuilt_sha256] entry for the running kernel 6.8.0-2000-aws"));
    assert_eq!(server.requests.load(Ordering::SeqCst), 1);
}

/// The daemon upgrades the driver in place: the GPUs leave the kubelet while the modules are
/// swapped, NVML is reopened, and the GPUs come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_withdraws_the_gpus_for_an_upgrade_and_advertises_them_again() {
    let node = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    let api = common::api_server_for(&node, &[]).await;
    write(&node.root, "sys/module/nvidia/version", "535.161.08\n");
    for m in ["nvidia_uvm", "nvidia_modeset"] {
        fs::create_dir_all(node.root.join("sys/module").join(m)).expect("module");
    }
    // Hold the upgrade with GPU work until the kubelet has seen the GPUs once.
    node.set_injection("processes", &format!("{} 4242 1024\n", common::gpu_uuid(0)));
    let kubelet = test_kubelet::TestKubelet::start(&node.plugin_dir(), test_kubelet::KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let t = std::time::Duration::from_secs(20);
    kubelet
        .wait_for_devices("nvidia.com/gpu", t, |d| d.len() == 2)
        .await
        .expect("advertised with the old driver");
    let status = node.wait_status(t, |s| common::stage_is(s, StageId::Driver, StageState::Pending));
    assert!(
        common::stage_error(&status, StageId::Driver).is_some_and(|e| e.contains("535.161.08 to 550.54.15 waits")),
        "{status:?}"
    );
    let mut events = kubelet.subscribe();
    node.set_injection("processes", "");
    // The next pass (a SIGHUP re-reads everything) upgrades.
    agent.sighup();
    let status = node.wait_status(t, |s| {
        common::stage_is(s, StageId::Driver, StageState::Ok)
            && common::stage_is(s, StageId::DevicePlugin, StageState::Ok)
    });
    assert!(
        common::stage_detail(&status, StageId::Driver).is_some_and(|d| d.contains("driver 550.54.15 on 2 GPU(s)")),
        "{status:?}"
    );
    let log = agent.log_text();
    assert!(
        log.contains("withdrawing 2 GPU(s) from the kubelet for the driver change"),
        "{log}"
    );
    let ran = commands(&node);
    assert!(
        ran.contains(&"rmmod nvidia".to_string()) && ran.contains(&"modprobe nvidia".to_string()),
        "{ran:?}"
    );
    kubelet
        .wait_for_devices("nvidia.com/gpu", t, |d| d.len() == 2)
        .await
        .expect("advertised again after the upgrade");
    // In between, the kubelet lost them: the resource's stream ended (no devices left to serve)
    // or listed none.
    let withdrawn = gpus_withdrawn(&mut events);
    assert!(withdrawn, "the GPUs were withdrawn from the kubelet during the upgrade");

    // The upgrade is posted on the Node once: not while it waited, not at a later pass.
    let event = common::event_posted(&api, "DriverUpgraded").await;
    common::assert_event(&event, "Normal", &["driver upgraded", "550.54.15"]);
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "DriverUpgraded").len(),
        1,
        "{:?}",
        api.events()
    );
    for reason in ["DriverInstalled", "DriverFailed"] {
        assert!(common::events_with(&api, reason).is_empty(), "{:?}", api.events());
    }
}

/// A driver the daemon installs is posted on the Node once (`DriverInstalled`); a later pass
/// with nothing to do posts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_the_daemon_installs_is_posted_once_as_an_event() {
    let node = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    let api = common::api_server_for(&node, &[]).await;
    let agent = node.spawn();
    let event = common::event_posted(&api, "DriverInstalled").await;
    common::assert_event(
        &event,
        "Normal",
        &["driver installed", "apt-get install", "nvidia-utils-550-server"],
    );
    let t = std::time::Duration::from_secs(20);
    node.wait_status(t, |s| common::stage_is(s, StageId::Driver, StageState::Ok));
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "DriverInstalled").len(),
        1,
        "{:?}",
        api.events()
    );
    for reason in ["DriverUpgraded", "DriverFailed"] {
        assert!(common::events_with(&api, reason).is_empty(), "{:?}", api.events());
    }
}

/// The old driver's node for an upgrade to `VERSION` from packages: 535 loaded, with
/// nvidia-persistenced and the fabric manager active.
fn upgrade_node(config: &str) -> Node {
    node_with_535_loaded(config, &["nvidia_uvm", "nvidia_modeset"])
}

#[test]
fn an_upgrade_stops_the_driver_services_before_unloading_and_starts_them_after_loading() {
    let node = upgrade_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let apt = "apt-get -o DPkg::Lock::Timeout=600";
    let env = "  DEBIAN_FRONTEND=noninteractive".to_string();
    assert_eq!(
        commands(&node),
        [
            "systemctl is-active --quiet nvidia-fabricmanager.service".to_string(),
            "systemctl stop nvidia-fabricmanager.service".to_string(),
            "systemctl is-active --quiet nvidia-persistenced.service".to_string(),
            "systemctl stop nvidia-persistenced.service".to_string(),
            "rmmod nvidia_modeset".to_string(),
            "rmmod nvidia_uvm".to_string(),
            "rmmod nvidia".to_string(),
            format!("{apt} -q update"),
            env.clone(),
            format!(
                "{apt} -y -q --no-install-recommends install linux-modules-nvidia-550-server-{KERNEL} \
                 nvidia-headless-no-dkms-550-server nvidia-utils-550-server"
            ),
            env,
            "modprobe nvidia".to_string(),
            "modprobe nvidia-uvm".to_string(),
            "modprobe nvidia-modeset".to_string(),
            // Started again on the new driver; persistenced turns persistence mode on itself.
            "systemctl start nvidia-persistenced.service".to_string(),
            "systemctl start nvidia-fabricmanager.service".to_string(),
        ]
    );
    assert!(text(&out).contains("driver 550.54.15 on 2 GPU(s)"), "{}", text(&out));

    // Services that do not run are neither stopped nor started for the change.
    let idle = upgrade_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    fs::remove_dir_all(idle.tmp.path().join("active-units")).expect("all inactive");
    let out = idle.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let systemctl: Vec<String> = commands(&idle)
        .into_iter()
        .filter(|c| c.starts_with("systemctl"))
        .collect();
    assert_eq!(
        systemctl,
        [
            "systemctl is-active --quiet nvidia-fabricmanager.service",
            "systemctl is-active --quiet nvidia-persistenced.service",
            // The persistence step, as on a fresh install.
            "systemctl start nvidia-persistenced.service",
        ]
    );
}

#[test]
fn a_failed_unload_starts_the_stopped_services_again_and_installs_nothing() {
    let node = upgrade_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    // nvidia stays: something still holds it.
    stand_in(
        &node,
        "/usr/sbin/rmmod",
        &log_path(&node),
        &format!(
            "if [ \"$1\" = nvidia ]; then echo 'rmmod: ERROR: Module nvidia is in use' >&2; exit 1; fi; rm -rf \"{}/$1\"",
            node.root.join("sys/module").display()
        ),
    );
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("unload nvidia") && text(&out).contains("Module nvidia is in use"),
        "{}",
        text(&out)
    );
    let ran = commands(&node);
    let tail: Vec<&str> = ran.iter().skip(4).map(String::as_str).collect();
    assert_eq!(
        tail,
        [
            "rmmod nvidia_modeset",
            "rmmod nvidia_uvm",
            "rmmod nvidia",
            "systemctl start nvidia-persistenced.service",
            "systemctl start nvidia-fabricmanager.service",
        ],
        "{ran:?}"
    );
    assert!(
        node.root.join("sys/module/nvidia/version").exists(),
        "the old driver stays loaded"
    );
}

#[test]
fn a_package_of_the_wanted_branch_is_not_installed_again_for_another_point_release() {
    // The default package names use {branch}: the archive has 550.54.15 (what the stand-in
    // modprobe loads) where 550.54.14 is asked for.
    let node = bare_node("[driver]\nsource = \"package\"\nversion = \"550.54.14\"\n");
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("driver 550.54.15 on 2 GPU(s)"), "{}", text(&out));
    let installs = || commands(&node).iter().filter(|c| c.contains(" install ")).count();
    assert_eq!(installs(), 1);

    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("driver 550.54.15 loaded (branch 550") && text(&out).contains("nothing to do"),
        "{}",
        text(&out)
    );
    assert_eq!(installs(), 1, "not installed again: {:?}", commands(&node));
    let status = node.run(&["driver", "status"]);
    assert!(
        !text(&status).contains("FAIL"),
        "validation accepts the branch: {}",
        text(&status)
    );
}

/// Package names that pin the version (`{version}`) where the archive's package loads another.
const PINNED_MISMATCH: &str = "[driver]\nsource = \"package\"\nversion = \"550.54.16\"\n\
                               [driver.package_names]\nubuntu = [\"nvidia-driver-{version}\"]\n";

#[test]
fn a_package_install_that_loads_another_version_fails_naming_both_and_the_package() {
    let node = bare_node(PINNED_MISMATCH);
    let out = node.run(&["driver", "install"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(
            "installed nvidia-driver-550.54.16 but the loaded driver is 550.54.15, not the 550.54.16 [driver] version asks for"
        ),
        "{}",
        text(&out)
    );
}

/// Polls the agent's log until `pred` holds.
fn wait_log(agent: &common::Agent, timeout: std::time::Duration, pred: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let log = agent.log_text();
        if pred(&log) {
            return log;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the log did not reach the expected state in {timeout:?}:\n{log}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn the_daemon_does_not_install_again_after_an_install_gave_another_version() {
    let node = bare_node(&format!("[kubernetes]\nenabled = false\n{PINNED_MISMATCH}"));
    let agent = node.spawn();
    let t = std::time::Duration::from_secs(20);
    let status = node.wait_status(t, |s| {
        common::stage_error(s, StageId::Driver)
            .is_some_and(|e| e.contains("not installed again") && e.contains("nothing was changed"))
    });
    assert_eq!(
        common::stage(&status, StageId::Driver).state,
        StageState::Failed,
        "{status:?}"
    );
    let passes = |log: &str| log.matches("driver stage failed").count();
    let before = passes(&agent.log_text());
    // More passes, with NVML up and no GPU work: still no second install.
    for pass in 1..=2 {
        agent.sighup();
        wait_log(&agent, t, |log| passes(log) >= before + pass);
    }
    let installs: Vec<String> = commands(&node)
        .into_iter()
        .filter(|c| c.contains(" install "))
        .collect();
    assert_eq!(installs.len(), 1, "{:?}", commands(&node));
    assert!(
        commands(&node).iter().all(|c| !c.starts_with("rmmod")),
        "{:?}",
        commands(&node)
    );
}

/// An upgrade that fails once the GPUs were withdrawn (here `rmmod nvidia`: the module is in
/// use) gives them back on the driver still loaded, with the stage failed and the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upgrade_in_the_daemon_reopens_nvml_and_advertises_the_gpus_again() {
    let node = upgrade_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    let api = common::api_server_for(&node, &[]).await;
    stand_in(
        &node,
        "/usr/sbin/rmmod",
        &log_path(&node),
        &format!(
            "if [ \"$1\" = nvidia ]; then echo 'rmmod: ERROR: Module nvidia is in use' >&2; exit 1; fi; rm -rf \"{}/$1\"",
            node.root.join("sys/module").display()
        ),
    );
    node.set_injection("processes", &format!("{} 4242 1024\n", common::gpu_uuid(0)));
    let kubelet = test_kubelet::TestKubelet::start(&node.plugin_dir(), test_kubelet::KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let t = std::time::Duration::from_secs(20);
    kubelet
        .wait_for_devices("nvidia.com/gpu", t, |d| d.len() == 2)
        .await
        .expect("advertised with the old driver");
    node.wait_status(t, |s| common::stage_is(s, StageId::Driver, StageState::Pending));
    let mut events = kubelet.subscribe();
    node.set_injection("processes", "");
    agent.sighup();
    let status = node.wait_status(t, |s| {
        common::stage_is(s, StageId::Driver, StageState::Failed)
            && common::stage_is(s, StageId::DevicePlugin, StageState::Ok)
    });
    assert!(
        common::stage_error(&status, StageId::Driver).is_some_and(|e| e.contains("Module nvidia is in use")),
        "{status:?}"
    );
    kubelet
        .wait_for_devices("nvidia.com/gpu", t, |d| d.len() == 2)
        .await
        .expect("advertised again after the failed upgrade");
    let withdrawn = gpus_withdrawn(&mut events);
    assert!(withdrawn, "the GPUs were withdrawn for the upgrade");
    let log = agent.log_text();
    assert!(log.contains("advertising") && log.contains("again"), "{log}");
    let ran = commands(&node);
    assert!(
        ran.contains(&"systemctl start nvidia-persistenced.service".to_string()),
        "{ran:?}"
    );

    // The next passes do not try the same upgrade again (withdrawing the GPUs each time).
    let mut events = kubelet.subscribe();
    for _ in 0..2 {
        agent.sighup();
        let status = node.wait_status(t, |s| {
            common::stage_error(s, StageId::Driver).is_some_and(|e| e.contains("tried again in"))
        });
        assert_eq!(common::stage(&status, StageId::Driver).state, StageState::Failed);
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        commands(&node).len(),
        ran.len(),
        "no command ran again: {:?}",
        commands(&node)
    );
    assert!(!gpus_withdrawn(&mut events), "withdrawn again");

    // One DriverFailed, for the pass that failed: the passes that stay failed post none.
    let event = common::event_posted(&api, "DriverFailed").await;
    common::assert_event(&event, "Warning", &["driver stage failed", "Module nvidia is in use"]);
    assert_eq!(common::events_with(&api, "DriverFailed").len(), 1, "{:?}", api.events());
    for reason in ["DriverInstalled", "DriverUpgraded"] {
        assert!(common::events_with(&api, reason).is_empty(), "{:?}", api.events());
    }
}

/// Whether the kubelet events so far show `nvidia.com/gpu` withdrawn: its stream ended, or it
/// listed no devices.
fn gpus_withdrawn(events: &mut tokio::sync::broadcast::Receiver<test_kubelet::Event>) -> bool {
    let mut withdrawn = false;
    while let Ok(event) = events.try_recv() {
        match event {
            test_kubelet::Event::Disconnected { resource, .. } if resource == "nvidia.com/gpu" => withdrawn = true,
            test_kubelet::Event::Devices { resource, devices, .. }
                if resource == "nvidia.com/gpu" && devices.is_empty() =>
            {
                withdrawn = true
            }
            _ => {}
        }
    }
    withdrawn
}

/// A GPU on the PCI bus that NVML does not list is named by its sysfs address (NVML writes
/// `00000000:10:00.0`, sysfs `0000:10:00.0`: the listed ones match across the formats).
#[test]
fn the_gpu_count_check_names_the_pci_device_nvml_does_not_list() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    write(&node.root, "etc/os-release", UBUNTU);
    write(&node.root, "proc/sys/kernel/osrelease", &format!("{KERNEL}\n"));
    for (file, value) in [("vendor", "0x10de\n"), ("device", "0x20b0\n"), ("class", "0x030200\n")] {
        write(&node.root, &format!("sys/bus/pci/devices/0000:c1:00.0/{file}"), value);
    }
    let out = node.run(&["driver", "status"]);
    assert_eq!(out.status.code(), Some(1), "a failed check fails the command");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("failed check(s): ") && text(&out).contains("gpu-count"),
        "{}",
        text(&out)
    );
    let check = text(&out)
        .lines()
        .find(|l| l.contains("gpu-count"))
        .unwrap_or_default()
        .to_string();
    assert!(
        check.starts_with("FAIL")
            && check
                .contains("NVML sees 2 GPU(s) but 3 NVIDIA PCI devices are present: NVML does not list 0000:c1:00.0: ")
            && check.contains("`lspci -k -s 0000:c1:00.0`"),
        "{}",
        text(&out)
    );
    // The driver stage (and so validation) fails with the same words.
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let error = common::stage_error(&node.status(), StageId::Driver)
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("NVML does not list 0000:c1:00.0"), "{error}");
}

/// A daemon-ready node that builds the driver from a verified runfile, with `make` replaced by
/// a stand-in running `make_body` (a slow or failing build). The server must outlive the test.
fn node_building_with(probe: &Path, make_body: &str) -> (Node, Server) {
    let body = runfile(&probe.join("ran"));
    let sha = sha256_hex(&body);
    let server = serve(body);
    let node = bare_node(&format!(
        "[kubernetes]\nenabled = false\n[driver]\nsource = \"runfile\"\nversion = \"{VERSION}\"\n\
         runfile_url = \"{}\"\nrunfile_sha256 = \"{sha}\"\n",
        server.url
    ));
    headers_in_root(&node);
    fs::remove_file(node.root.join("usr/bin/make")).expect("unlink make");
    stand_in(&node, "/usr/bin/make", &log_path(&node), make_body);
    (node, server)
}

/// A module build on a fresh node runs before READY: while it runs the agent asks systemd for
/// more start time (EXTEND_TIMEOUT_USEC, at the watchdog's cadence here), so `TimeoutStartSec`
/// does not kill a build that is within its own limit.
#[test]
fn a_long_build_before_ready_extends_the_start_timeout() {
    let probe = tempfile::tempdir().expect("tmp");
    let (node, _server) = node_building_with(probe.path(), "sleep 1.5; exit 2");
    let socket = common::NotifySocket::new();
    let agent = node.spawn_with(|cmd| {
        cmd.env("NOTIFY_SOCKET", &socket.path).env("WATCHDOG_USEC", "400000");
    });
    let got = socket.receive_until(std::time::Duration::from_secs(30), |m| {
        m.iter().any(|x| x.contains("READY=1"))
    });
    let ready = got.iter().position(|m| m.contains("READY=1")).expect("READY=1");
    let extended = got[..ready]
        .iter()
        .filter(|m| m.as_str() == "EXTEND_TIMEOUT_USEC=600000")
        .count();
    assert!(extended >= 3, "{got:?}");
    assert!(
        got[ready..].iter().all(|m| !m.starts_with("EXTEND_TIMEOUT_USEC")),
        "not after READY: {got:?}"
    );
    assert_eq!(agent.stop(), 0);
}

/// SIGTERM while the daemon builds the driver's modules (a `make` that would take a minute)
/// stops it within a second: the build's whole process group is killed, nothing is loaded or
/// cached, and the next start plans the same build again.
#[test]
fn sigterm_during_a_slow_driver_build_stops_within_a_second_and_the_build_is_planned_again() {
    let probe = tempfile::tempdir().expect("tmp");
    let pid_file = probe.path().join("make.pid");
    let (node, _server) = node_building_with(probe.path(), &format!("echo $$ > \"{}\"\nsleep 60", pid_file.display()));
    let agent = node.spawn();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let make_pid = loop {
        if let Some(pid) = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the build never started:\n{}",
            agent.log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let (code, took) = agent.stop_timed();
    assert_eq!(code, 0);
    assert!(took < std::time::Duration::from_secs(1), "SIGTERM took {took:?}");
    // The build's process group went with it (a zombie would still answer kill -0 until reaped
    // by init, so look at /proc's state too).
    let alive = fs::read_to_string(format!("/proc/{make_pid}/stat"))
        .is_ok_and(|stat| !stat.split(") ").nth(1).is_some_and(|rest| rest.starts_with('Z')));
    assert!(!alive, "make ({make_pid}) still runs");
    assert_eq!(node.status().state, "stopped");
    assert!(
        commands(&node).iter().all(|c| !c.starts_with("insmod")),
        "{:?}",
        commands(&node)
    );
    let status = node.run(&["driver", "status"]);
    assert!(text(&status).contains("build"), "{}", text(&status));
}

/// The H200 host of issue 33: driver 580.159.04 installed by other means (its libraries found
/// through ld.so.conf.d), `nvidia` and `nvidia_uvm` loaded, no `nvidia_modeset`: display and DRM
/// need it, compute does not, and many GPU hosts never load it.
const H200_HOST: &str = r#"
driver_version = "580.159.04"
cuda_driver_version = 13000

[[gpu]]
model = "H200-141GB"
uuid = "GPU-00000000-1111-2222-3333-444455556666"
numa_node = 0
"#;

/// The simulated node shaped like [`H200_HOST`]: `nvidia_modeset` is not in `/sys/module`.
fn compute_only_node(config: &str) -> Node {
    let node = Node::new(H200_HOST, config);
    fs::remove_dir_all(node.root.join("sys/module/nvidia_modeset")).expect("no nvidia_modeset");
    assert!(node.root.join("sys/module/nvidia_uvm").is_dir());
    node
}

#[test]
fn driver_status_passes_a_compute_node_whose_driver_came_by_other_means_without_nvidia_modeset() {
    let node = compute_only_node("[driver]\nsource = \"none\"\n");
    let out = node.run(&["driver", "status"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(t.contains("loaded        580.159.04 (nvidia, nvidia_uvm)"), "{t}");
    assert!(
        t.contains(
            "ok   modules    loaded: nvidia, nvidia_uvm (nvidia refcnt 2); nvidia_modeset is not loaded, which \
             compute does not need ([driver] require_modeset = false)"
        ),
        "{t}"
    );
    assert!(!t.contains("FAIL") && !t.contains("modprobe"), "{t}");

    let out = node.run(&["driver", "status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let checks: Vec<(String, bool)> = json["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|c| (c["name"].as_str().unwrap_or("").to_string(), c["ok"] == true))
        .collect();
    assert_eq!(
        checks,
        [
            ("nvml", true),
            ("gpu-count", true),
            ("version", true),
            ("modules", true)
        ]
        .map(|(n, ok)| (n.to_string(), ok))
    );
}

#[test]
fn require_modeset_fails_the_same_node_naming_the_module_and_the_key() {
    let node = compute_only_node("[driver]\nsource = \"none\"\nrequire_modeset = true\n");
    let out = node.run(&["driver", "status"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains(
            "FAIL modules    nvidia_modeset not loaded (nvidia_modeset: [driver] require_modeset = true): load with \
             `modprobe -a nvidia-modeset` ([driver] source = \"none\": the agent loads no module)"
        ),
        "{t}"
    );
    assert!(t.contains("failed check(s): modules"), "{t}");
}

/// Where the agent loads the driver itself, `nvidia_modeset` is required: a wanted driver loaded
/// without it fails validation, naming it, and the stage loads it rather than failing every pass.
#[test]
fn where_the_stage_loads_the_driver_a_missing_nvidia_modeset_fails_and_the_stage_loads_it() {
    let node = bare_node(&format!("[driver]\nsource = \"package\"\nversion = \"{VERSION}\"\n"));
    write(&node.root, "sys/module/nvidia/version", &format!("{VERSION}\n"));
    fs::create_dir_all(node.root.join("sys/module/nvidia_uvm")).expect("nvidia_uvm");
    let out = node.run(&["driver", "status"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains(
            "FAIL modules    nvidia_modeset not loaded (nvidia_modeset: the driver stage loads it with the others): \
             load with `modprobe -a nvidia-modeset` or run the driver stage again"
        ),
        "{t}"
    );
    assert!(
        t.contains("plan: driver 550.54.15 loaded; nvidia-modeset not loaded"),
        "{t}"
    );

    let out = node.run(&["driver", "install"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(t.contains("driver 550.54.15 on 2 GPU(s)"), "{t}");
    assert_eq!(commands(&node), ["modprobe nvidia-modeset"], "{t}");
    let out = node.run(&["driver", "status"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// The daemon on the H200-shaped node: the driver stage and validation pass, the
/// `validation.state` label says `success`, and no Warning Event calls the node broken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_reports_a_compute_node_without_nvidia_modeset_healthy() {
    let node = compute_only_node("[driver]\nsource = \"none\"\n");
    let api = common::api_server_for(&node, &[]).await;
    let kubelet = test_kubelet::TestKubelet::start(&node.plugin_dir(), test_kubelet::KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let t = std::time::Duration::from_secs(20);
    let status = node.wait_status(t, |s| common::stage_is(s, StageId::Validation, StageState::Ok));
    let driver = common::stage(&status, StageId::Driver);
    assert_eq!(driver.state, StageState::Ok, "{driver:?}");
    assert!(
        driver
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("driver 580.159.04 on 1 GPU(s)")),
        "{driver:?}"
    );
    assert_eq!(
        common::label(&status, "nvidia.com/gpu-node-agent.validation.state"),
        Some("success"),
        "{}",
        agent.log_text()
    );
    common::another_pass(&agent).await;
    let status = node.status();
    assert_eq!(common::stage(&status, StageId::Driver).state, StageState::Ok);
    assert_eq!(common::stage(&status, StageId::Validation).state, StageState::Ok);
    for reason in ["DriverFailed", "ValidationFailed"] {
        assert!(common::events_with(&api, reason).is_empty(), "{:?}", api.events());
    }
    assert!(
        !api.events().iter().any(|e| e.to_string().contains("modeset")),
        "{:?}",
        api.events()
    );
    assert!(
        !agent.log_text().contains("nvidia_modeset not loaded"),
        "{}",
        agent.log_text()
    );
    drop(kubelet);
}
