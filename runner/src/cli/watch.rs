//! `cairn-runner watch`.

use cairn_proto::domain::CheckpointReason;

use super::WatchArgs;
use crate::watch::{WatchOptions, watch};

pub(super) async fn main(args: WatchArgs) -> anyhow::Result<()> {
    watch(WatchOptions {
        checkpoint: args.target.checkpoint_options(CheckpointReason::Manual),
        socket: args.socket,
        interval: args.interval,
        full_scan_interval: args.full_scan_interval,
    })
    .await
}
