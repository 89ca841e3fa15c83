//! The hooks on root file systems built the way a hostile image would build them. These run as
//! root (CI does): the sandbox and the bind mount need it. The end-to-end proof with real runc
//! and crun is `tests/cdi_hostile.rs` of the agent.

use super::*;
use std::os::unix::fs::symlink;
use std::process::Command;

fn state_for(bundle: &Path) -> String {
    format!(
        r#"{{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":1,"bundle":"{}"}}"#,
        bundle.display()
    )
}

/// A temp dir with `rootfs/` and `canary/` (a host folder beside the root, with one file).
struct Tree {
    dir: tempfile::TempDir,
}

impl Tree {
    fn new() -> Tree {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("rootfs")).expect("rootfs");
        std::fs::create_dir_all(dir.path().join("canary")).expect("canary");
        std::fs::write(dir.path().join("canary/keep"), "host file").expect("canary file");
        Tree { dir }
    }
    fn root(&self) -> PathBuf {
        self.dir.path().join("rootfs")
    }
    fn canary(&self) -> PathBuf {
        self.dir.path().join("canary")
    }
    fn at(&self, path: &str) -> PathBuf {
        self.root().join(path.trim_start_matches('/'))
    }
    fn mkdir(&self, path: &str) {
        std::fs::create_dir_all(self.at(path)).expect("mkdir");
    }
    fn link(&self, target: &Path, path: &str) {
        let at = self.at(path);
        std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
        symlink(target, at).expect("symlink");
    }
    fn fifo(&self, path: &str) {
        let at = self.at(path);
        std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &at,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .expect("mkfifo");
    }
    fn zero(&self, path: &str) {
        let at = self.at(path);
        std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &at,
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::from_raw_mode(0o666),
            rustix::fs::makedev(1, 5),
        )
        .expect("mknod /dev/zero");
    }
    /// The canary folder's names and contents; nothing outside the root may change them.
    fn canary_state(&self) -> Vec<(String, String)> {
        let mut seen: Vec<(String, String)> = std::fs::read_dir(self.canary())
            .expect("canary")
            .map(|e| {
                let e = e.expect("entry");
                let meta = std::fs::symlink_metadata(e.path()).expect("meta");
                let what = if meta.is_file() {
                    std::fs::read_to_string(e.path()).unwrap_or_default()
                } else {
                    format!("{:?}", meta.file_type())
                };
                (e.file_name().to_string_lossy().into_owned(), what)
            })
            .collect();
        seen.sort();
        seen
    }
    /// A stub `libcuda.so.550.54.15` (soname `libcuda.so.1`) in `dir` of the root.
    fn libcuda(&self, dir: &str) {
        self.mkdir(dir);
        let src = self.dir.path().join("cuda.c");
        std::fs::write(&src, "int cuInit(unsigned f) { return (int)f; }\n").expect("source");
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
            .arg(self.at(&format!("{dir}/libcuda.so.550.54.15")))
            .arg(&src)
            .output()
            .expect("cc");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    /// What the root's linker cache holds, as the host's ldconfig prints it.
    fn cache(&self) -> String {
        let out = Command::new("/sbin/ldconfig")
            .arg("-p")
            .arg("-C")
            .arg(self.at("/etc/ld.so.cache"))
            .output()
            .expect("ldconfig -p");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

fn ldcache(folders: &[&str]) -> Hook {
    Hook::UpdateLdcache {
        folders: folders.iter().map(PathBuf::from).collect(),
        ldconfig: None,
    }
}

fn links(pairs: &[(&str, &str)]) -> Hook {
    Hook::CreateSymlinks {
        links: pairs
            .iter()
            .map(|(target, path)| (target.to_string(), PathBuf::from(path)))
            .collect(),
    }
}

fn root_only() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    eprintln!("skipped: needs root (namespaces and mounts); CI runs as root");
    false
}

#[test]
fn the_root_is_root_path_of_the_bundle_config_relative_to_the_bundle() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"}}"#,
    )
    .unwrap();
    let root = container_root(state_for(dir.path()).as_bytes()).unwrap();
    assert_eq!(root, dir.path().join("rootfs"));
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"root":{"path":"/var/lib/x/merged"}}"#,
    )
    .unwrap();
    assert_eq!(
        container_root(state_for(dir.path()).as_bytes()).unwrap(),
        Path::new("/var/lib/x/merged")
    );
}

#[test]
fn a_bad_state_or_bundle_is_an_error_naming_it() {
    let err = container_root(&b"not json"[..]).unwrap_err().to_string();
    assert!(err.contains("OCI state"), "{err}");
    let err = container_root(&br#"{"bundle":"rel"}"#[..]).unwrap_err().to_string();
    assert!(err.contains("\"rel\" is not an absolute path"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let err = container_root(state_for(dir.path()).as_bytes())
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(dir.path().join("config.json"), "{}").unwrap();
    let err = container_root(state_for(dir.path()).as_bytes())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no root.path"), "{err}");
}

#[test]
fn a_bundle_config_that_is_a_fifo_is_refused_without_blocking() {
    let tree = Tree::new();
    let bundle = tree.dir.path();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        bundle.join("config.json"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let err = container_root(state_for(bundle).as_bytes()).unwrap_err().to_string();
    assert!(
        err.contains("config.json: expected a regular file, found a FIFO"),
        "{err}"
    );
}

#[test]
fn the_command_line_is_parsed_strictly() {
    let args = |s: &[&str]| s.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
    assert_eq!(
        parse_args(&args(&["update-ldcache", "--folder", "/usr/lib64", "--folder=/opt/x"])).unwrap(),
        ldcache(&["/usr/lib64", "/opt/x"])
    );
    assert_eq!(
        parse_args(&args(&[
            "create-symlinks",
            "--link",
            "libcuda.so.1::/usr/lib64/libcuda.so"
        ]))
        .unwrap(),
        links(&[("libcuda.so.1", "/usr/lib64/libcuda.so")])
    );
    assert_eq!(
        parse_args(&args(&["enable-cuda-compat", "--host-driver-version=550.54.15"])).unwrap(),
        Hook::EnableCudaCompat {
            host_driver_version: "550.54.15".into()
        }
    );
    for bad in [
        &[][..],
        &["nope"],
        &["update-ldcache", "--folder"],
        &["update-ldcache", "--link", "a::/b"],
        &["create-symlinks", "--link", "rel"],
        &["enable-cuda-compat"],
        &["disable-device-node-modification", "extra"],
    ] {
        assert!(parse_args(&args(bad)).is_err(), "{bad:?}");
    }
    for bad in ["libcuda.so.1", "::/x", "t::rel", "t::/dir/"] {
        assert!(parse_link(bad).is_err(), "{bad}");
    }
}

#[test]
fn create_symlinks_makes_the_links_inside_the_root_and_replaces_what_the_image_had() {
    let tree = Tree::new();
    let root = tree.root();
    // An absolute link to a host folder beside the root that points nowhere inside the root: not
    // followed, the hook fails naming it.
    tree.link(&tree.canary(), "/usr/lib/escape");
    let err = run_in(&links(&[("libcuda.so.1", "/usr/lib/escape/libcuda.so")]), &root)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("/usr/lib/escape: a symbolic link to a folder that does not exist in the container"),
        "{err}"
    );
    // Where the same path exists inside the root, the link resolves there.
    tree.mkdir(&tree.canary().to_string_lossy());
    let hook = links(&[
        ("libcuda.so.550.54.15", "/usr/lib64/libcuda.so.1"),
        ("libcuda.so.1", "/usr/lib/escape/libcuda.so"),
    ]);
    run_in(&hook, &root).unwrap();
    assert_eq!(
        std::fs::read_link(root.join("usr/lib64/libcuda.so.1")).unwrap(),
        Path::new("libcuda.so.550.54.15")
    );
    let inside = tree.at(&tree.canary().join("libcuda.so").to_string_lossy());
    assert_eq!(std::fs::read_link(inside).unwrap(), Path::new("libcuda.so.1"));
    assert_eq!(tree.canary_state(), [("keep".to_string(), "host file".to_string())]);
    // Twice is fine.
    run_in(&hook, &root).unwrap();
    // A file of the image (a driver library of another version), a FIFO and a device are
    // replaced by the link without being opened.
    std::fs::write(root.join("usr/lib64/libnvidia-ml.so.1"), "image's own").unwrap();
    tree.fifo("/usr/lib64/libnvidia-cfg.so.1");
    tree.zero("/usr/lib64/libnvidia-ptxjitcompiler.so.1");
    for name in ["libnvidia-ml", "libnvidia-cfg", "libnvidia-ptxjitcompiler"] {
        let link = format!("/usr/lib64/{name}.so.1");
        run_in(&links(&[(&format!("{name}.so.550.54.15"), &link)]), &root).unwrap();
        assert_eq!(
            std::fs::read_link(tree.at(&link)).unwrap(),
            Path::new(&format!("{name}.so.550.54.15"))
        );
    }
    // A folder is not.
    tree.mkdir("/usr/lib64/libnvidia-encode.so.1");
    let err = run_in(
        &links(&[("libnvidia-encode.so.550.54.15", "/usr/lib64/libnvidia-encode.so.1")]),
        &root,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("/usr/lib64/libnvidia-encode.so.1 is a folder"), "{err}");
    let names: Vec<_> = std::fs::read_dir(root.join("usr/lib64"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 5, "no temporary links left: {names:?}");
}

#[test]
fn cuda_compat_is_enabled_only_for_a_newer_compat_libcuda_inside_the_root() {
    let tree = Tree::new();
    let root = tree.root();
    let compat = |r: &Path| r.join(CUDA_COMPAT_CONF.trim_start_matches('/'));
    let hook = |v: &str| Hook::EnableCudaCompat {
        host_driver_version: v.into(),
    };
    // No compat folder: nothing.
    run_in(&hook("550.54.15"), &root).unwrap();
    assert!(!compat(&root).exists());
    // The compat folder as a link to a host folder holding a newer libcuda: the host's folder is
    // never listed (the link resolves inside the root, where there is nothing).
    std::fs::write(tree.canary().join("libcuda.so.999.1.1"), "").unwrap();
    tree.link(&tree.canary(), CUDA_COMPAT_DIR);
    run_in(&hook("550.54.15"), &root).unwrap();
    assert!(!compat(&root).exists(), "the host's folder was read");
    std::fs::remove_file(tree.at(CUDA_COMPAT_DIR)).unwrap();
    tree.mkdir(CUDA_COMPAT_DIR);
    std::fs::write(tree.at("/usr/local/cuda/compat/libcuda.so.545.23.08"), "").unwrap();
    run_in(&hook("550.54.15"), &root).unwrap();
    assert!(
        !compat(&root).exists(),
        "an older compat libcuda must not shadow the driver"
    );
    std::fs::write(tree.at("/usr/local/cuda/compat/libcuda.so.570.86.10"), "").unwrap();
    run_in(&hook("550.54.15"), &root).unwrap();
    let text = std::fs::read_to_string(compat(&root)).unwrap();
    assert!(text.lines().any(|l| l == CUDA_COMPAT_DIR), "{text}");
    assert!(matches!(run_in(&hook("x"), &root), Err(HookError::BadVersion(_))));
    // The file it writes replaces a FIFO there without opening it.
    std::fs::remove_file(compat(&root)).unwrap();
    tree.fifo(CUDA_COMPAT_CONF);
    run_in(&hook("550.54.15"), &root).unwrap();
    assert!(std::fs::symlink_metadata(compat(&root)).unwrap().is_file());
    assert_eq!(tree.canary_state().len(), 2);
}

#[test]
fn update_ldcache_runs_the_hosts_ldconfig_for_an_image_without_one() {
    if !root_only() {
        return;
    }
    for layout in ["/usr/lib64", "/usr/lib/x86_64-linux-gnu"] {
        let tree = Tree::new();
        tree.libcuda(layout);
        run_in(
            &links(&[("libcuda.so.550.54.15", &format!("{layout}/libcuda.so.1"))]),
            &tree.root(),
        )
        .unwrap();
        run_in(&ldcache(&[layout]), &tree.root()).unwrap();
        let cache = tree.cache();
        assert!(
            cache.contains(&format!("libcuda.so.1 (libc6,x86-64) => {layout}/libcuda.so.1")),
            "{layout}: {cache}"
        );
        let conf = std::fs::read_to_string(tree.at(LDCACHE_CONF)).unwrap();
        assert!(conf.lines().any(|l| l == layout), "{conf}");
        assert_eq!(
            std::fs::read_to_string(tree.at("/etc/ld.so.conf")).unwrap(),
            "include /etc/ld.so.conf.d/*.conf\n"
        );
    }
}

#[test]
fn update_ldcache_never_runs_the_images_ldconfig() {
    if !root_only() {
        return;
    }
    let tree = Tree::new();
    tree.libcuda("/usr/lib64");
    // The image's "ldconfig" would leave a marker in the root (and try the host's canary).
    let marker = tree.canary().join("pwned");
    for at in ["/sbin/ldconfig", "/sbin/ldconfig.real", "/usr/sbin/ldconfig"] {
        tree.mkdir(Path::new(at).parent().unwrap().to_str().unwrap());
        std::fs::write(tree.at(at), format!("#!/bin/sh\ntouch /ran {}\n", marker.display())).unwrap();
        std::fs::set_permissions(tree.at(at), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    run_in(&ldcache(&["/usr/lib64"]), &tree.root()).unwrap();
    assert!(!tree.at("/ran").exists());
    assert!(!marker.exists());
    assert!(tree.cache().contains("libcuda.so.550.54.15") || tree.cache().contains("libcuda.so.1"));
}

#[test]
fn update_ldcache_refuses_special_files_it_or_ldconfig_would_read() {
    if !root_only() {
        return;
    }
    for (what, make) in [
        ("a FIFO", Tree::fifo as fn(&Tree, &str)),
        ("a character device", Tree::zero as fn(&Tree, &str)),
    ] {
        for path in [CUDA_COMPAT_CONF, "/etc/ld.so.conf", "/etc/ld.so.conf.d/zz-image.conf"] {
            let tree = Tree::new();
            tree.libcuda("/usr/lib64");
            make(&tree, path);
            let started = std::time::Instant::now();
            let err = run_in(&ldcache(&["/usr/lib64"]), &tree.root()).unwrap_err().to_string();
            assert!(err.contains(path) && err.contains(what), "{path}: {err}");
            assert!(started.elapsed() < LDCONFIG_TIMEOUT, "{path} was waited on");
        }
        // Where the hook writes, the special file is replaced instead, and ldconfig then runs.
        let tree = Tree::new();
        tree.libcuda("/usr/lib64");
        make(&tree, LDCACHE_CONF);
        make(&tree, "/etc/ld.so.cache");
        // ldconfig's temporary files (O_CREAT|O_TRUNC would block on a FIFO) and its auxiliary
        // cache (not read: -i).
        make(&tree, "/etc/ld.so.cache~");
        make(&tree, "/var/cache/ldconfig/aux-cache");
        make(&tree, "/var/cache/ldconfig/aux-cache~");
        run_in(&ldcache(&["/usr/lib64"]), &tree.root()).unwrap();
        assert!(std::fs::symlink_metadata(tree.at(LDCACHE_CONF)).unwrap().is_file());
        assert!(
            std::fs::symlink_metadata(tree.at("/etc/ld.so.cache"))
                .unwrap()
                .is_file()
        );
    }
}

#[test]
fn update_ldcache_follows_no_link_out_of_the_root() {
    if !root_only() {
        return;
    }
    let tree = Tree::new();
    tree.libcuda("/usr/lib64");
    let before = tree.canary_state();
    // ld.so.conf.d, ld.so.conf and the cache as links to host paths beside the root.
    tree.link(&tree.canary(), "/etc/ld.so.conf.d");
    tree.link(&tree.canary().join("conf"), "/etc/ld.so.conf");
    tree.link(&tree.canary().join("cache"), "/etc/ld.so.cache");
    let err = run_in(&ldcache(&["/usr/lib64"]), &tree.root()).unwrap_err().to_string();
    assert!(err.contains("/etc/ld.so.conf.d: a symbolic link"), "{err}");
    assert_eq!(tree.canary_state(), before);
    tree.mkdir(&tree.canary().to_string_lossy());
    run_in(&ldcache(&["/usr/lib64"]), &tree.root()).unwrap();
    assert_eq!(tree.canary_state(), before);
    // What was written went to the same paths inside the root.
    let inside = tree.at(&tree.canary().join("00-gpu-node-agent.conf").to_string_lossy());
    assert!(inside.is_file(), "{}", inside.display());
}

#[test]
fn the_sandbox_sees_only_the_container_and_no_privilege() {
    if !root_only() || !Path::new("/bin/busybox").is_file() {
        eprintln!("skipped: needs root and busybox-static");
        return;
    }
    let tree = Tree::new();
    tree.mkdir("/inside-only");
    let program = std::fs::File::open("/bin/busybox").unwrap();
    let run = |args: &[&str]| {
        let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        sandbox::run(&program, &args, &tree.root(), Duration::from_secs(10))
    };
    // The root is the container's: a host path beside it is not there.
    run(&["ls", "/inside-only"]).unwrap();
    let canary = tree.canary().join("keep");
    let err = run(&["cat", canary.to_str().unwrap()]).unwrap_err();
    assert!(err.contains("No such file"), "{err}");
    let err = run(&["touch", tree.canary().join("new").to_str().unwrap()]).unwrap_err();
    assert!(err.contains("exit status 1"), "{err}");
    // Mounting, chroot, and starting another program are refused.
    tree.mkdir("/mnt");
    let err = run(&["mount", "-t", "tmpfs", "x", "/mnt"]).unwrap_err();
    assert!(err.contains("exit status"), "{err}");
    let err = run(&["chroot", "/mnt", "/x"]).unwrap_err();
    assert!(err.contains("exit status"), "{err}");
    std::fs::copy("/bin/busybox", tree.at("/busybox")).unwrap();
    let err = run(&["sh", "-c", "/busybox true"]).unwrap_err();
    assert!(err.contains("exit status"), "{err}");
    // A program that does not end is killed at the limit.
    let started = std::time::Instant::now();
    let err = sandbox::run(
        &program,
        &["sleep".into(), "60".into()],
        &tree.root(),
        Duration::from_millis(300),
    )
    .unwrap_err();
    assert!(err.contains("did not finish"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(tree.canary_state(), [("keep".to_string(), "host file".to_string())]);
}

#[test]
fn only_root_owned_static_programs_are_run_as_ldconfig() {
    assert!(ldcache::open_host_program(Path::new("/sbin/ldconfig")).is_ok());
    let err = ldcache::open_host_program(Path::new("/bin/sh")).unwrap_err();
    assert!(err.contains("dynamically linked"), "{err}");
    let tree = Tree::new();
    let script = tree.dir.path().join("script");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    assert!(ldcache::open_host_program(&script).unwrap_err().contains("not an ELF"));
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    assert!(
        ldcache::open_host_program(&script)
            .unwrap_err()
            .contains("writable by others")
    );
    let err = run_in(
        &Hook::UpdateLdcache {
            folders: vec!["/usr/lib64".into()],
            ldconfig: Some(script),
        },
        &tree.root(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no usable static ldconfig on the host"), "{err}");
}
