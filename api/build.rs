//! Generates the kubelet's gRPC APIs from `proto/` with the pure-Rust `protox`, so no `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "../proto/deviceplugin/v1beta1/api.proto",
        "../proto/podresources/v1/api.proto",
        "../proto/pluginregistration/v1/api.proto",
        "../proto/dra/v1/api.proto",
        "../proto/dra/v1beta1/api.proto",
        "../proto/dra-health/v1alpha1/api.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["../proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
