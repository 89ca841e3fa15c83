//! A simulated arm64 node (Grace Hopper) on whatever machine the tests run: the fake NVML's host
//! files for a machine with `arch = "aarch64"` put the driver's libraries in
//! `/usr/lib/aarch64-linux-gnu` and say `aarch64` in `/proc/sys/kernel/arch`, which the agent
//! reads under its root. The agent's CDI spec and driver plan follow the node, not the build.

mod common;

use common::Node;

const GH200: &str = r#"arch = "aarch64"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "GH200-144GB"
numa_node = 0
"#;

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn the_cdi_spec_of_an_arm64_node_mounts_the_aarch64_libraries() {
    let node = Node::new(GH200, "[kubernetes]\nenabled = false\n");
    // An x86_64 copy of the driver (a foreign-architecture package): never the node's driver.
    let foreign = node.root.join("usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15");
    std::fs::write(&foreign, "").expect("foreign libcuda");
    let out = node.run(&["cdi", "generate", "--output", "-"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let spec: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the spec is JSON");
    let mounts: Vec<String> = spec["containerEdits"]["mounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .map(|m| m["hostPath"].as_str().unwrap_or_default().to_string())
        .collect();
    for lib in ["libcuda", "libnvidia-ml"] {
        let path = format!("/usr/lib/aarch64-linux-gnu/{lib}.so.550.54.15");
        assert!(mounts.contains(&path), "{path} in {mounts:?}");
    }
    assert!(!mounts.iter().any(|m| m.contains("x86_64")), "{mounts:?}");
}

#[test]
fn the_driver_plan_of_an_arm64_node_downloads_the_aarch64_runfile() {
    let node = Node::new(
        GH200,
        &format!(
            "[kubernetes]\nenabled = false\n[driver]\nsource = \"runfile\"\nversion = \"570.86.15\"\n\
             runfile_url = \"https://download.nvidia.com/XFree86/Linux-{{arch}}/{{version}}/NVIDIA-Linux-{{arch}}-{{version}}.run\"\n\
             runfile_sha256 = \"{}\"\n",
            "ab".repeat(32)
        ),
    );
    std::fs::write(
        node.root.join("etc/os-release"),
        "ID=ubuntu\nID_LIKE=debian\nVERSION_ID=\"24.04\"\n",
    )
    .expect("os-release");
    std::fs::create_dir_all(node.root.join("proc/sys/kernel")).expect("mkdir");
    std::fs::write(node.root.join("proc/sys/kernel/osrelease"), "6.8.0-1015-nvidia-64k\n").expect("osrelease");
    let out = node.run(&["driver", "status"]);
    let said = text(&out);
    assert!(
        said.contains("https://download.nvidia.com/XFree86/Linux-aarch64/570.86.15/NVIDIA-Linux-aarch64-570.86.15.run"),
        "{said}"
    );
    assert!(said.contains("linux-headers-6.8.0-1015-nvidia-64k"), "{said}");
    assert!(said.contains("kernel        6.8.0-1015-nvidia-64k (aarch64)"), "{said}");
}
