//! Generates the tonic/prost code for every `.proto` under `proto/`.
//!
//! protoc comes from the vendored crate, so building this crate needs no system protoc.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "proto/eventmesh/v1/eventmesh.proto",
    "proto/eventmesh/offset/v1/offset.proto",
    "proto/eventmesh/puller/v1/puller.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("eventmesh_descriptor.bin"))
        .bytes(".eventmesh")
        .compile_with_config(config, PROTOS, &["proto"])?;
    // The server side of the client API once more, sending Subscribe responses the dispatcher
    // encoded itself, reading ACK ids without a String each and a publish batch's entries as
    // the bytes received (`crate::encoded`): every other type is the one generated above.
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    let encoded_dir = out_dir.join("encoded");
    std::fs::create_dir_all(&encoded_dir)?;
    tonic_prost_build::configure()
        .out_dir(&encoded_dir)
        .build_client(false)
        .extern_path(
            ".eventmesh.v1.SubscribeResponse",
            "crate::encoded::SubscribeResponseBytes",
        )
        .extern_path(
            ".eventmesh.v1.SubscribeRequest",
            "crate::encoded::SubscribeRequestIn",
        )
        .extern_path(
            ".eventmesh.v1.PublishBatchRequest",
            "crate::encoded::PublishBatchRequestIn",
        )
        .extern_path(".eventmesh.v1", "crate::eventmesh::v1")
        .compile_with_config(config, &[PROTOS[0]], &["proto"])?;
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
