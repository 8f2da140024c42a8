//! `cairn-runner run`: the flags of the sandbox's runner become
//! [`RunOptions`] and a [`RemoteStore`] per workspace, then [`run`] drives
//! the attempt.

use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use super::{RunArgs, default_cache_dir};
use crate::run::{
    Arming, Control, RemoteStore, RunOptions, StoreTarget, WorkspaceStore, cancel_on_signals,
    connect, run,
};
use crate::socket as control_socket;

pub(super) async fn main(args: RunArgs) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    cancel_on_signals(shutdown.clone()).context("cannot handle signals")?;
    let token = args
        .token
        .filter(|t| !t.trim().is_empty())
        .context("no run token: set CAIRN_RUN_TOKEN")?;
    let coordinator = connect(&args.coordinator, &token).await?;
    let control = Control::new(coordinator.auth_channel());
    let cache_dir = args.cache_dir.unwrap_or_else(default_cache_dir);
    let pack_cache = args.pack_cache.config();
    let root = args.root;
    let resident: Arc<tokio::sync::OnceCell<_>> = Default::default();
    let arming: Arc<Arming> = Default::default();
    let stores = |target: StoreTarget| -> Arc<dyn WorkspaceStore> {
        Arc::new(RemoteStore {
            coordinator: args.coordinator.clone(),
            token: token.clone(),
            root: root.clone(),
            cache_dir: cache_dir.clone(),
            pack_cache: pack_cache.clone(),
            target,
            limits: args.limits.limits(),
            resident: resident.clone(),
            arming: arming.clone(),
        })
    };
    let root_for_socket = std::path::absolute(&root).unwrap_or_else(|_| root.clone());
    let options = RunOptions {
        control_socket: Some(
            args.control_socket
                .unwrap_or_else(|| control_socket::default_socket(&cache_dir, &root_for_socket)),
        ),
        coordinator: Some(args.coordinator.clone()),
        ..RunOptions::new(root.clone())
    };
    let finished = run(control, &stores, options, shutdown).await;
    if let Some(resident) = resident.get() {
        resident.settle().await;
    }
    let finished = finished?;
    tracing::info!(?finished, "runner done");
    Ok(())
}
