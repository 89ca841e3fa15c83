//! Compiles the same vendored kubelet APIs as the agent (../proto), with protox: the device
//! plugin API (v1beta1), the pod-resources API (v1), the plugin-watcher registration API and the
//! DRA node service (v1, v1beta1), each with server and client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in [
        "../proto/deviceplugin/v1beta1/api.proto",
        "../proto/podresources/v1/api.proto",
        "../proto/pluginregistration/api.proto",
        "../proto/dra/v1/api.proto",
        "../proto/dra/v1beta1/api.proto",
    ] {
        println!("cargo:rerun-if-changed={proto}");
        let fds = protox::compile([proto], ["../proto"])?;
        tonic_prost_build::configure()
            .build_server(true)
            .build_client(true)
            .compile_fds(fds)?;
    }
    Ok(())
}
