//! Compiles the vendored kubelet APIs with protox, a pure-Rust protobuf compiler, so building
//! needs no `protoc` on the machine: the device plugin API (v1beta1; server and client) and the
//! pod-resources API (v1; client only, for the pod labels on the GPU metrics), and the CRI's
//! RuntimeService Version and Status (client, and a server for the tests' stand-in engine); the
//! plugin-watcher registration API and the DRA node service (v1 and v1beta1), servers only: the
//! agent is the kubelet's DRA plugin.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/deviceplugin/v1beta1/api.proto";
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;

    let pod_resources = "proto/podresources/v1/api.proto";
    println!("cargo:rerun-if-changed={pod_resources}");
    let fds = protox::compile([pod_resources], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(fds)?;

    let cri = "proto/cri/runtime/v1/api.proto";
    println!("cargo:rerun-if-changed={cri}");
    let fds = protox::compile([cri], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;

    let dra = [
        "proto/pluginregistration/api.proto",
        "proto/dra/v1/api.proto",
        "proto/dra/v1beta1/api.proto",
    ];
    for proto in dra {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(dra, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(false)
        .compile_fds(fds)?;
    Ok(())
}
