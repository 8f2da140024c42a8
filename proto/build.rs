//! Compiles `proto/cairn/v1/*.proto` with protox (no `protoc` install needed)
//! and writes the descriptor set that server reflection serves.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "common",
        "workspace",
        "checkpoint",
        "run",
        "host",
        "runner",
        "admin",
        "refusal",
    ]
    .map(|name| format!("proto/cairn/v1/{name}.proto"))
    .into_iter()
    .chain(["proto/google/rpc/status.proto".to_owned()])
    .collect::<Vec<_>>();
    for file in &files {
        println!("cargo:rerun-if-changed={file}");
    }
    let fds = protox::compile(&files, ["proto"])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("cairn_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
