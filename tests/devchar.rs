//! `/dev/char/<major>:<minor>` links to the NVIDIA device nodes (issue 33, failure 3): systemd
//! rebuilds a container's device rules from them at every `daemon-reload`, and without them
//! containers under the systemd cgroup driver lose their GPUs. The real binary on a simulated
//! node (fake NVML, device nodes made with mknod, so these tests need root as CI has it).

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use common::Node;

/// The driver's character majors as a host shows them in `/proc/devices`.
const PROC_DEVICES: &str = "Character devices:\n  1 mem\n  4 tty\n  8 sd\n195 nvidia-frontend\n226 drm\n\
                            237 nvidia-caps\n238 nvidia-uvm\n\nBlock devices:\n  7 loop\n";

fn two_a100s() -> String {
    let mut m = common::DGX_A100.to_string();
    for i in 0..2 {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n",
            common::gpu_uuid(i)
        ));
    }
    m
}

fn config(layout: &str) -> String {
    format!("[kubernetes]\nenabled = false\n[mig]\ndefault_layout = \"{layout}\"\n")
}

fn need_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test creates device nodes (mknod) and needs root (CI runs as root)"
    );
}

/// `major:minor` of the character device at `path` (not following a symlink).
fn numbers(path: &Path) -> Option<String> {
    let meta = fs::symlink_metadata(path).ok()?;
    meta.file_type().is_char_device().then(|| {
        let rdev = meta.rdev();
        format!("{}:{}", nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev))
    })
}

/// Every NVIDIA character device under the node's `/dev` (and `/dev/nvidia-caps`): host path ->
/// `major:minor`.
fn nvidia_nodes(node: &Node) -> BTreeMap<String, String> {
    let mut nodes = BTreeMap::new();
    for (dir, host) in [("dev", "/dev"), ("dev/nvidia-caps", "/dev/nvidia-caps")] {
        let Ok(entries) = fs::read_dir(node.root.join(dir)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let (true, Some(n)) = (name.starts_with("nvidia"), numbers(&e.path())) {
                nodes.insert(format!("{host}/{name}"), n);
            }
        }
    }
    nodes
}

/// `/dev/char` as it is: name -> link target (`None`: not a link).
fn dev_char(node: &Node) -> BTreeMap<String, Option<PathBuf>> {
    fs::read_dir(node.root.join("dev/char"))
        .map(|d| {
            d.flatten()
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        fs::read_link(e.path()).ok(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Every NVIDIA node has its relative link, which leads to a character device with its numbers;
/// `except`: numbers whose entry is someone else's.
fn assert_linked(node: &Node, except: &[&str], when: &str) -> usize {
    let nodes = nvidia_nodes(node);
    let links = dev_char(node);
    let mut checked = 0;
    for (path, n) in nodes.iter().filter(|(_, n)| !except.contains(&n.as_str())) {
        let want = PathBuf::from(format!("..{}", path.trim_start_matches("/dev")));
        assert_eq!(
            links.get(n),
            Some(&Some(want)),
            "{when}: /dev/char/{n} for {path}: {links:?}"
        );
        // Followed, it is the node.
        let followed = fs::metadata(node.root.join("dev/char").join(n)).expect("follow the link");
        assert!(followed.file_type().is_char_device(), "{when}: {n}");
        assert_eq!(
            format!(
                "{}:{}",
                nix::sys::stat::major(followed.rdev()),
                nix::sys::stat::minor(followed.rdev())
            ),
            *n
        );
        checked += 1;
    }
    checked
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn plan_json(node: &Node) -> serde_json::Value {
    let out = node.run(&["plan", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("plan JSON")
}

/// On a node without nvidia-modprobe (the agent makes the device nodes), every NVIDIA node
/// (control, GPUs, modeset, UVM, the MIG caps) gets its `/dev/char` link, `plan` and `status` show
/// them, a MIG layout change links the new MIG devices' capability nodes, a second pass writes
/// nothing, and `runtime unconfigure` removes exactly the links the agent made: udev's link and
/// someone else's entry stay as they were.
#[test]
fn every_nvidia_node_gets_its_dev_char_link_and_unconfigure_removes_the_agents() {
    need_root();
    let node = Node::new(&two_a100s(), &config("all-3g.20gb"));
    fs::write(node.root.join("proc/devices"), PROC_DEVICES).expect("proc/devices");
    let char_dir = node.root.join("dev/char");
    fs::create_dir_all(&char_dir).expect("mkdir /dev/char");
    // udev's link for nvidiactl (made before the node, as a udev rule would): the agent's to keep.
    std::os::unix::fs::symlink("../nvidiactl", char_dir.join("195:255")).expect("udev link");
    // Someone else's entry where GPU 1's link would go: reported, left alone.
    std::os::unix::fs::symlink("../sdb", char_dir.join("195:1")).expect("foreign link");
    common::char_node(&node.root.join("dev/sdb"), 8, 16);

    // The plan names the links of the nodes it would make, and the foreign entry.
    let plan = plan_json(&node);
    let create: Vec<&str> = plan["dev_char"]["create"]
        .as_array()
        .expect("dev_char.create")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    for link in [
        "/dev/char/195:0 -> ../nvidia0",
        "/dev/char/195:254 -> ../nvidia-modeset",
        "/dev/char/238:0 -> ../nvidia-uvm",
        "/dev/char/238:1 -> ../nvidia-uvm-tools",
        "/dev/char/237:1 -> ../nvidia-caps/nvidia-cap1",
        "/dev/char/237:2 -> ../nvidia-caps/nvidia-cap2",
    ] {
        assert!(create.contains(&link), "{link} not in {create:?}");
    }
    assert!(!create.iter().any(|l| l.starts_with("/dev/char/195:1 ")), "{create:?}");
    assert_eq!(plan["dev_char"]["present"][0], "/dev/char/195:255 -> ../nvidiactl");
    assert!(
        plan["dev_char"]["problems"][0]
            .as_str()
            .is_some_and(|p| p.contains("/dev/char/195:1 points to ../sdb, not to /dev/nvidia1")),
        "{}",
        plan["dev_char"]
    );
    let text = node.run(&["plan"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("/dev/char links (systemd's device rules): "), "{text}");
    assert!(text.contains("  create /dev/char/195:0 -> ../nvidia0\n"), "{text}");

    let mut seen = Vec::new();
    for layout in ["all-3g.20gb", "all-1g.5gb"] {
        node.write_config(&config(layout));
        let out = node.run(&["run", "--once"]);
        let log = stderr(&out);
        assert_eq!(out.status.code(), Some(0), "{log}");
        assert!(log.contains("created /dev/char link(s) "), "{layout}: {log}");
        assert!(
            log.contains("/dev/char links: /dev/char/195:1 points to ../sdb, not to /dev/nvidia1: left as it is"),
            "{layout}: {log}"
        );
        let linked = assert_linked(&node, &["195:1"], layout);
        // The MIG devices' capability nodes are among them.
        let caps = nvidia_nodes(&node)
            .keys()
            .filter(|p| p.starts_with("/dev/nvidia-caps/"))
            .count();
        seen.push((layout, caps));
        assert_eq!(
            fs::read_link(char_dir.join("195:1")).expect("foreign"),
            Path::new("../sdb")
        );
        assert_eq!(
            fs::read_link(char_dir.join("195:255")).expect("udev's"),
            Path::new("../nvidiactl")
        );

        let status = node.status();
        let dc = status.dev_char.as_ref().expect("dev_char in the status");
        assert_eq!(dc.links.len(), linked, "{dc:?}");
        // All of them but udev's nvidiactl link.
        assert_eq!(dc.made_by_agent, linked - 1, "{dc:?}");
        assert!(dc.problems.first().is_some_and(|p| p.contains("195:1")), "{dc:?}");
        let shown = node.run(&["status"]);
        let shown = String::from_utf8_lossy(&shown.stdout);
        assert!(
            shown.contains(&format!(
                "/dev/char links (systemd's device rules): {linked} to the NVIDIA device nodes, {} made by the agent",
                linked - 1
            )),
            "{shown}"
        );
    }
    // 3g.20gb: two MIG devices a GPU, 1g.5gb: seven; two capabilities each, with config and
    // monitor (the 3g devices' nodes stay after the change: nothing removes device nodes).
    assert_eq!(seen[0], ("all-3g.20gb", 2 + 2 * 2 * 2));
    assert!(seen[1].1 >= 2 + 2 * 7 * 2, "{seen:?}");

    // Steady state: a second pass makes and replaces nothing, and writes neither /dev/char nor
    // the record.
    let record = node.root.join("var/lib/gpu-node-agent/dev-char-links");
    let before = (
        fs::metadata(&char_dir).expect("dir"),
        fs::metadata(&record).expect("record"),
    );
    let out = node.run(&["run", "--once"]);
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert!(!log.contains("created /dev/char link"), "{log}");
    let after = (
        fs::metadata(&char_dir).expect("dir"),
        fs::metadata(&record).expect("record"),
    );
    assert_eq!(
        (before.0.mtime(), before.0.mtime_nsec(), before.0.ino()),
        (after.0.mtime(), after.0.mtime_nsec(), after.0.ino())
    );
    assert_eq!(
        (before.1.mtime(), before.1.mtime_nsec(), before.1.ino()),
        (after.1.mtime(), after.1.mtime_nsec(), after.1.ino())
    );
    let plan = plan_json(&node);
    assert_eq!(
        plan["dev_char"]["create"],
        serde_json::json!([]),
        "{}",
        plan["dev_char"]
    );
    assert_eq!(plan["dev_char"]["replace"], serde_json::json!([]));

    // Removal: exactly the agent's links go; udev's and the foreign one stay, and so do the nodes.
    let nodes = nvidia_nodes(&node);
    let out = node.run(&["runtime", "unconfigure", "--no-restart"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("removed the /dev/char link(s) the agent made: "),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
    let left = dev_char(&node);
    assert_eq!(
        left,
        BTreeMap::from([
            ("195:1".to_string(), Some(PathBuf::from("../sdb"))),
            ("195:255".to_string(), Some(PathBuf::from("../nvidiactl"))),
        ])
    );
    assert!(!record.exists(), "the record is gone with the links");
    assert_eq!(nvidia_nodes(&node), nodes);
}

/// A node whose device nodes come from elsewhere (`create_device_nodes = false`): hostile and
/// foreign things in `/dev` are not trusted. A regular file named like a GPU node gets no link, a
/// link someone else made for a node's numbers is reported and kept, a dangling link to an NVIDIA
/// path is replaced, and when `/dev/char` is a symlink to elsewhere nothing is written through it.
/// `runtime unconfigure` then leaves a link the agent made but someone re-pointed.
#[test]
fn foreign_and_hostile_dev_entries_are_left_alone() {
    need_root();
    let node = Node::new(
        &common::machine("A100-SXM4-40GB", 2),
        "[kubernetes]\nenabled = false\n[driver]\ncreate_device_nodes = false\n",
    );
    let dev = node.root.join("dev");
    common::char_node(&dev.join("nvidiactl"), 195, 255);
    common::char_node(&dev.join("nvidia0"), 195, 0);
    // Named like GPU 1's node, but a regular file.
    fs::write(dev.join("nvidia1"), "not a device").expect("fake node");
    common::char_node(&dev.join("nvidia-uvm"), 238, 0);
    common::char_node(&dev.join("nvidia-uvm-tools"), 238, 1);
    common::char_node(&dev.join("nvidia-caps/nvidia-cap1"), 237, 1);
    common::char_node(&dev.join("sda"), 8, 0);

    // /dev/char a symlink to another directory: nothing is made there, and it is said.
    let elsewhere = node.tmp.path().join("elsewhere");
    fs::create_dir(&elsewhere).expect("elsewhere");
    std::os::unix::fs::symlink(&elsewhere, dev.join("char")).expect("char symlink");
    let out = node.run(&["run", "--once"]);
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert!(
        log.contains("/dev/char is a symlink (to ") && log.contains("no links made through it"),
        "{log}"
    );
    assert_eq!(fs::read_dir(&elsewhere).expect("elsewhere").count(), 0);
    let status = node.status();
    assert_eq!(status.dev_char.map(|dc| dc.links), Some(Vec::new()));

    // A real /dev/char with a foreign link and a dangling one to an NVIDIA path.
    fs::remove_file(dev.join("char")).expect("rm link");
    fs::create_dir(dev.join("char")).expect("mkdir /dev/char");
    std::os::unix::fs::symlink("../sda", dev.join("char/195:0")).expect("foreign link");
    std::os::unix::fs::symlink("../nvidia-uvm-old", dev.join("char/238:0")).expect("dangling link");
    let out = node.run(&["run", "--once"]);
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert!(
        log.contains("/dev/nvidia1 is a regular file, not a character device: no /dev/char link for it"),
        "{log}"
    );
    assert!(
        log.contains("/dev/char/195:0 points to ../sda, not to /dev/nvidia0"),
        "{log}"
    );
    assert_eq!(
        dev_char(&node),
        BTreeMap::from([
            ("195:255".to_string(), Some(PathBuf::from("../nvidiactl"))),
            ("195:0".to_string(), Some(PathBuf::from("../sda"))),
            ("238:0".to_string(), Some(PathBuf::from("../nvidia-uvm"))),
            ("238:1".to_string(), Some(PathBuf::from("../nvidia-uvm-tools"))),
            ("237:1".to_string(), Some(PathBuf::from("../nvidia-caps/nvidia-cap1"))),
        ])
    );
    assert_eq!(node.status().dev_char.map(|dc| dc.made_by_agent), Some(4));

    // Someone re-points a link the agent made: unconfigure leaves it, and says so.
    fs::remove_file(dev.join("char/238:1")).expect("rm");
    std::os::unix::fs::symlink("../sdc", dev.join("char/238:1")).expect("re-point");
    let out = node.run(&["runtime", "unconfigure", "--no-restart"]);
    assert!(
        stderr(&out).contains("/dev/char/238:1 points to ../sdc now, not ../nvidia-uvm-tools: left as it is"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        dev_char(&node),
        BTreeMap::from([
            ("195:0".to_string(), Some(PathBuf::from("../sda"))),
            ("238:1".to_string(), Some(PathBuf::from("../sdc"))),
        ])
    );
}

/// `[driver] create_dev_char_links = false`: nothing is made, and `plan` says it is off.
#[test]
fn the_switch_turns_the_links_off() {
    need_root();
    let node = Node::new(
        &common::machine("A100-SXM4-40GB", 1),
        "[kubernetes]\nenabled = false\n[driver]\ncreate_device_nodes = false\ncreate_dev_char_links = false\n",
    );
    common::char_node(&node.root.join("dev/nvidiactl"), 195, 255);
    common::char_node(&node.root.join("dev/nvidia0"), 195, 0);
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!node.root.join("dev/char").exists());
    // Read as JSON on purpose: the file leaves the key out (not `null`) when the links are off.
    assert!(node.status_json().get("dev_char").is_none());
    let plan = node.run(&["plan"]);
    assert!(
        String::from_utf8_lossy(&plan.stdout).contains("/dev/char links: [driver] create_dev_char_links = false"),
        "{}",
        String::from_utf8_lossy(&plan.stdout)
    );
}
