//! The commits phase: concurrent workers commit checkpoints of their
//! workspaces, each referencing the one pack the workspace's first
//! checkpoint uploaded.
//!
//! Set-up, per workspace: CreateWorkspace, BeginCheckpoint (generation and
//! key id), PrepareUploads for one pack of a few hundred random bytes (its
//! id is their SHA-256, which the signed URL binds with the size), the PUT
//! with whatever headers the URL carries, and a CommitCheckpoint naming it
//! as a new pack that holds the root tree's blob id. The bytes are no real
//! pack (nothing here decrypts them): the coordinator checks only that the
//! pack is in the store at its declared size.
//!
//! Measured: worker `i` of `C` takes workspaces `i, i+C, …` in turn and
//! commits to each a checkpoint with no new pack, the same root tree, the
//! previous checkpoint as parent and a fresh request id, until the commits
//! asked for have been made (answered or failed) or the duration limit
//! passed. Each workspace is only ever committed to by its worker, one
//! commit at a time, so its sequence must go up by exactly one per commit.
//! A workspace's calls all go to one replica (its worker's): each replica's
//! embedded blob store is its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cairn_proto::ids::CommitRequestId;
use cairn_proto::pb;
use cairn_proto::pb::checkpoint_service_client::CheckpointServiceClient;
use cairn_proto::pb::workspace_service_client::WorkspaceServiceClient;
use futures::StreamExt as _;
use rand::RngCore as _;
use serde::Serialize;
use sha2::{Digest as _, Sha256};
use tokio::time::Instant;

use crate::cluster::{Cluster, ClusterOptions, ReplicaReport};
use crate::stats::{Errors, Latency, rate};
use crate::{AuthChannel, LoadError, auth_channel, bounded, bounded_duration, with_retries};

/// Workspaces set up at once.
const SETUP_CONCURRENCY: usize = 32;
/// Bytes of the one pack each workspace uploads.
const PACK_BYTES: usize = 384;
/// The made-up pack index: its last bytes (a commit declares where it is).
const INDEX_BYTES: u32 = 64;
/// `format_version` of the commits (any non-zero is accepted; the bytes
/// are no real pack of any version).
const FORMAT_VERSION: u32 = 1;

/// What the commits phase does.
#[derive(Debug, Clone)]
pub struct CommitsOptions {
    pub cluster: ClusterOptions,
    pub workspaces: usize,
    /// Workers committing at once (at most one per workspace).
    pub concurrency: usize,
    /// Commits in all, after the first checkpoints.
    pub commits: u64,
    /// The phase stops here, reporting what it had.
    pub duration_limit: Duration,
}

impl CommitsOptions {
    fn validate(&self) -> Result<(), LoadError> {
        self.cluster.validate()?;
        bounded(
            "--workspaces",
            self.workspaces as u64,
            1,
            crate::MAX_WORKSPACES,
        )?;
        bounded(
            "--concurrency",
            self.concurrency as u64,
            1,
            crate::MAX_CONCURRENCY,
        )?;
        bounded("--commits", self.commits, 1, crate::MAX_COMMITS)?;
        bounded_duration("--duration-limit", self.duration_limit)
    }
}

/// What the commits phase measured.
#[derive(Debug, Clone, Serialize)]
pub struct CommitsReport {
    pub replicas: usize,
    /// The PostgreSQL schema the coordinators used, if any.
    pub database_schema: Option<crate::cluster::SchemaReport>,
    pub workspaces: u64,
    /// Workers that committed: `--concurrency`, or fewer when there are
    /// fewer workspaces.
    pub workers: u64,
    /// Wall time of the set-up (workspaces and their first checkpoints).
    pub setup_seconds: f64,
    pub commits_requested: u64,
    pub commits_ok: u64,
    /// Failed commits, by gRPC code.
    pub errors: Errors,
    /// Answered commits per second, from the first commit sent to the last
    /// answer.
    pub commits_per_second: f64,
    /// CommitCheckpoint call latency (answered calls).
    pub commit: Latency,
    /// Commits answered with a sequence other than the workspace's
    /// previous one plus one (should be 0).
    pub sequence_errors: u64,
    /// The highest sequence any workspace reached.
    pub max_sequence: u64,
    /// Whether the duration limit cut the phase short.
    pub timed_out: bool,
    /// Wall time of the measured commits.
    pub seconds: f64,
    /// CPU time the harness itself used (it shares the machine with the
    /// coordinators it measures).
    pub harness_cpu_seconds: Option<f64>,
    pub coordinators: Vec<ReplicaReport>,
}

/// Starts the coordinators, runs the commits phase, stops them.
pub async fn commits(options: CommitsOptions) -> Result<CommitsReport, LoadError> {
    options.validate()?;
    let cluster = Cluster::start(&options.cluster, &[]).await?;
    let measured = run(&cluster, &options).await;
    let harness_cpu_seconds = crate::cluster::cpu_seconds("self");
    let (coordinators, schema) = cluster.stop().await;
    let mut report = measured?;
    report.harness_cpu_seconds = harness_cpu_seconds;
    report.database_schema = schema;
    report.coordinators = coordinators;
    Ok(report)
}

/// A workspace as its worker knows it.
#[derive(Debug, Clone)]
struct Workspace {
    id: String,
    generation: u64,
    key_id: String,
    pack_id: String,
    root_tree: Vec<u8>,
    parent: String,
    sequence: u64,
}

/// What one worker measured.
#[derive(Debug, Default)]
struct Tally {
    latencies: Vec<Duration>,
    errors: Errors,
    sequence_errors: u64,
    max_sequence: u64,
    first_sent: Option<Instant>,
    last_answered: Option<Instant>,
    cut_off: bool,
}

async fn run(cluster: &Cluster, options: &CommitsOptions) -> Result<CommitsReport, LoadError> {
    let started = Instant::now();
    let deadline = started + options.duration_limit;
    let workers = options.concurrency.min(options.workspaces);
    let replicas = cluster.replicas.len();
    let mut report = CommitsReport {
        replicas,
        database_schema: None,
        workspaces: options.workspaces as u64,
        workers: workers as u64,
        setup_seconds: 0.0,
        commits_requested: options.commits,
        commits_ok: 0,
        errors: Errors::default(),
        commits_per_second: 0.0,
        commit: Latency::default(),
        sequence_errors: 0,
        max_sequence: 0,
        timed_out: false,
        seconds: 0.0,
        harness_cpu_seconds: None,
        coordinators: Vec::new(),
    };

    // Worker i talks to replica i % replicas over channel i / replicas.
    let client_of = |worker: usize| -> Result<AuthChannel, LoadError> {
        let replica = &cluster.replicas[worker % replicas];
        auth_channel(replica.channel(worker / replicas), &replica.admin_token)
    };
    let http = reqwest::Client::builder()
        .build()
        .map_err(|e| LoadError::Setup(format!("an HTTP client cannot be built: {e}")))?;
    let setting_up = futures::stream::iter(0..options.workspaces)
        .map(|w| {
            let worker = w % workers;
            let http = http.clone();
            let channel = client_of(worker);
            async move { set_up(channel?, &http, w).await.map(|ws| (w, ws)) }
        })
        .buffer_unordered(SETUP_CONCURRENCY)
        .collect::<Vec<_>>();
    let set = match tokio::time::timeout_at(deadline, setting_up).await {
        Ok(set) => set,
        Err(_) => {
            report.timed_out = true;
            report.setup_seconds = started.elapsed().as_secs_f64();
            return Ok(report);
        }
    };
    let mut owned: Vec<Vec<(usize, Workspace)>> = vec![Vec::new(); workers];
    for outcome in set {
        let (w, workspace) = outcome?;
        owned[w % workers].push((w, workspace));
    }
    report.setup_seconds = started.elapsed().as_secs_f64();

    let issued = Arc::new(AtomicU64::new(0));
    let measuring = Instant::now();
    let mut tasks = Vec::with_capacity(workers);
    for (worker, mut mine) in owned.into_iter().enumerate() {
        mine.sort_by_key(|(w, _)| *w);
        let workspaces = mine.into_iter().map(|(_, ws)| ws).collect();
        let client = CheckpointServiceClient::new(client_of(worker)?);
        tasks.push(tokio::spawn(work(
            client,
            workspaces,
            issued.clone(),
            options.commits,
            deadline,
        )));
    }
    let mut latencies = Vec::new();
    let (mut first_sent, mut last_answered): (Option<Instant>, Option<Instant>) = (None, None);
    for task in tasks {
        let tally = task
            .await
            .map_err(|e| LoadError::Setup(format!("a commit worker failed: {e}")))?;
        latencies.extend(tally.latencies);
        report.errors.merge(tally.errors);
        report.sequence_errors += tally.sequence_errors;
        report.max_sequence = report.max_sequence.max(tally.max_sequence);
        report.timed_out |= tally.cut_off;
        first_sent = match (first_sent, tally.first_sent) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        last_answered = last_answered.max(tally.last_answered);
    }
    report.seconds = measuring.elapsed().as_secs_f64();
    report.commits_ok = latencies.len() as u64;
    if let (Some(first), Some(last)) = (first_sent, last_answered) {
        report.commits_per_second = rate(report.commits_ok, last.saturating_duration_since(first));
    }
    report.commit = Latency::of(latencies);
    Ok(report)
}

/// Creates workspace number `w` and its first checkpoint (a real upload).
async fn set_up(
    channel: AuthChannel,
    http: &reqwest::Client,
    w: usize,
) -> Result<Workspace, LoadError> {
    let workspaces = WorkspaceServiceClient::new(channel.clone());
    let checkpoints = CheckpointServiceClient::new(channel);
    let created = with_retries(&format!("creating workspace {w}"), || {
        let mut client = workspaces.clone();
        async move {
            client
                // Unnamed: names are unique per tenant, and a kept
                // database schema may hold an earlier run's.
                .create_workspace(pb::CreateWorkspaceRequest {
                    name: String::new(),
                })
                .await
                .map(tonic::Response::into_inner)
        }
    })
    .await?;
    let id = created.id;
    let begun = with_retries(&format!("beginning a checkpoint of {id}"), || {
        let mut client = checkpoints.clone();
        let workspace = id.clone();
        async move {
            client
                .begin_checkpoint(pb::BeginCheckpointRequest {
                    workspace,
                    generation: 0,
                })
                .await
                .map(tonic::Response::into_inner)
        }
    })
    .await?;
    let key_id = begun
        .key
        .as_ref()
        .map(|k| k.key_id.clone())
        .ok_or_else(|| LoadError::Setup(format!("BeginCheckpoint of {id} gave no key")))?;

    let mut bytes = vec![0u8; PACK_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    let mut root_tree = vec![0u8; 32];
    rand::rng().fill_bytes(&mut root_tree);
    let pack_id = hex::encode(Sha256::digest(&bytes));
    let size = bytes.len() as u64;

    let urls = with_retries(&format!("preparing the upload of {id}"), || {
        let mut client = checkpoints.clone();
        let request = pb::PrepareUploadsRequest {
            workspace: id.clone(),
            packs: vec![pb::PackUpload {
                pack_id: pack_id.clone(),
                size,
                kind: pb::PackKind::Meta as i32,
            }],
        };
        async move {
            client
                .prepare_uploads(request)
                .await
                .map(tonic::Response::into_inner)
        }
    })
    .await?;
    let url = urls
        .urls
        .into_iter()
        .find(|u| u.pack_id == pack_id)
        .ok_or_else(|| LoadError::Setup(format!("PrepareUploads of {id} gave no URL")))?;
    upload(http, &url, bytes).await?;

    let request = pb::CommitCheckpointRequest {
        workspace: id.clone(),
        generation: begun.generation,
        parent_checkpoint_id: begun.parent_checkpoint_id.clone(),
        reason: pb::CheckpointReason::Manual as i32,
        format_version: FORMAT_VERSION,
        root_tree: root_tree.clone(),
        new_packs: vec![pb::NewPack {
            pack_id: pack_id.clone(),
            kind: pb::PackKind::Meta as i32,
            size,
            index_offset: size - u64::from(INDEX_BYTES),
            index_length: INDEX_BYTES,
            blob_ids: vec![root_tree.clone()],
        }],
        referenced_packs: vec![pack_id.clone()],
        stats: Some(pb::CheckpointStats {
            files: 1,
            uploaded_bytes: size,
            packs_uploaded: 1,
            ..Default::default()
        }),
        key_id: key_id.clone(),
        // One id for all tries: a retry of a commit that went through
        // gets that checkpoint.
        request_id: CommitRequestId::generate().to_string(),
        ..Default::default()
    };
    let first = with_retries(&format!("the first checkpoint of {id}"), || {
        let mut client = checkpoints.clone();
        let request = request.clone();
        async move {
            client
                .commit_checkpoint(request)
                .await
                .map(tonic::Response::into_inner)
        }
    })
    .await?;
    Ok(Workspace {
        id,
        generation: begun.generation,
        key_id,
        pack_id,
        root_tree,
        parent: first.id,
        sequence: first.sequence,
    })
}

/// PUTs `bytes` to a signed URL with the headers it was signed with.
async fn upload(
    http: &reqwest::Client,
    url: &pb::SignedUrl,
    bytes: Vec<u8>,
) -> Result<(), LoadError> {
    if !url.method.is_empty() && !url.method.eq_ignore_ascii_case("PUT") {
        return Err(LoadError::Setup(format!(
            "the upload URL of pack {} is for {}, not PUT",
            url.pack_id, url.method
        )));
    }
    let mut request = http.put(&url.url);
    for (name, value) in &url.headers {
        request = request.header(name, value);
    }
    let failed = |why: String| LoadError::Setup(format!("uploading pack {}: {why}", url.pack_id));
    let response = request
        .body(bytes)
        .send()
        .await
        .map_err(|e| failed(e.without_url().to_string()))?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        return Err(failed(format!("{status}: {body}")));
    }
    Ok(())
}

/// One worker: commits to its workspaces in turn while commits remain to
/// be issued and the deadline has not passed.
async fn work(
    mut client: CheckpointServiceClient<AuthChannel>,
    mut workspaces: Vec<Workspace>,
    issued: Arc<AtomicU64>,
    total: u64,
    deadline: Instant,
) -> Tally {
    let mut tally = Tally::default();
    if workspaces.is_empty() {
        return tally;
    }
    let mut next = 0;
    loop {
        if Instant::now() >= deadline {
            tally.cut_off = issued.load(Ordering::Relaxed) < total;
            return tally;
        }
        if issued.fetch_add(1, Ordering::Relaxed) >= total {
            return tally;
        }
        let count = workspaces.len();
        let ws = &mut workspaces[next % count];
        next += 1;
        let request = pb::CommitCheckpointRequest {
            workspace: ws.id.clone(),
            generation: ws.generation,
            parent_checkpoint_id: ws.parent.clone(),
            reason: pb::CheckpointReason::Manual as i32,
            format_version: FORMAT_VERSION,
            root_tree: ws.root_tree.clone(),
            new_packs: Vec::new(),
            referenced_packs: vec![ws.pack_id.clone()],
            stats: Some(pb::CheckpointStats {
                files: 1,
                ..Default::default()
            }),
            key_id: ws.key_id.clone(),
            request_id: CommitRequestId::generate().to_string(),
            ..Default::default()
        };
        let sent = Instant::now();
        tally.first_sent.get_or_insert(sent);
        let answered = tokio::time::timeout_at(deadline, client.commit_checkpoint(request)).await;
        match answered {
            Ok(Ok(checkpoint)) => {
                let answered_at = Instant::now();
                tally.latencies.push(answered_at - sent);
                tally.last_answered = Some(answered_at);
                let checkpoint = checkpoint.into_inner();
                if checkpoint.sequence != ws.sequence + 1 {
                    tally.sequence_errors += 1;
                }
                tally.max_sequence = tally.max_sequence.max(checkpoint.sequence);
                ws.sequence = checkpoint.sequence;
                ws.parent = checkpoint.id;
            }
            Ok(Err(status)) => tally.errors.record(&status),
            Err(_) => {
                tally.cut_off = true;
                return tally;
            }
        }
    }
}
