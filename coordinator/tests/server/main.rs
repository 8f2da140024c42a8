//! In-process tests of the coordinator: a real server on ephemeral ports,
//! driven with tonic clients and HTTP like runners, hosts and cairnctl
//! drive it.

mod azure;
mod blob_urls;
mod chats;
mod checkpoints;
mod fencing;
mod fleet;
mod gc;
mod harness;
mod hosts;
mod isolation;
mod metrics;
mod remote_stores;
mod replicas;
mod restart;
mod runs;
mod s3;
mod stations;
mod tokens;
mod workspaces;
