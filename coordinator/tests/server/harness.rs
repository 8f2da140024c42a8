//! An in-process coordinator on ephemeral ports, and helpers that drive the
//! checkpoint protocol the way a runner does (real packs, real uploads).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cairn_coordinator::db::DatabaseLocation;
use cairn_coordinator::store::{Faults, FaultyStore, ObjectStore};
use cairn_coordinator::{ServeError, ServerConfig};
use cairn_engine::client::{AuthChannel, CoordinatorClient};
use cairn_engine::format::{FinishedPack, PackBuilder, TenantKeys, seal};
use cairn_proto::domain::PackKind;
use cairn_proto::pb;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// A coordinator serving from a data directory until stopped.
pub struct TestServer {
    pub data_dir: PathBuf,
    pub grpc_url: String,
    pub blob_url: String,
    pub admin_token: String,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServeError>>>,
    /// A data directory the server owns: removed after it.
    owned_dir: Option<tempfile::TempDir>,
}

/// The database the coordinator of `data_dir` uses in a test: the
/// PostgreSQL one `CAIRN_TEST_DATABASE` names, in a schema of its own (the
/// same after a restart), or the data dir's SQLite file.
pub fn test_location(data_dir: &Path) -> DatabaseLocation {
    match cairn_utils::testing::test_database(data_dir) {
        Some((url, schema)) => url
            .parse::<DatabaseLocation>()
            .and_then(|location| location.in_schema(&schema))
            .expect("CAIRN_TEST_DATABASE is a PostgreSQL URL"),
        None => DatabaseLocation::sqlite(data_dir.join("cairn.db")),
    }
}

impl TestServer {
    /// Starts a coordinator on `data_dir`, letting `configure` adjust the config.
    pub async fn start_with(data_dir: &Path, configure: impl FnOnce(&mut ServerConfig)) -> Self {
        Self::start_serving(data_dir, configure, None).await
    }

    /// Starts a coordinator on `data_dir` that serves its metrics too; also
    /// returns their URL.
    pub async fn start_with_metrics(data_dir: &Path) -> (Self, String) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/metrics", listener.local_addr().unwrap());
        (
            Self::start_serving(data_dir, |_| {}, Some(listener)).await,
            url,
        )
    }

    async fn start_serving(
        data_dir: &Path,
        configure: impl FnOnce(&mut ServerConfig),
        metrics: Option<TcpListener>,
    ) -> Self {
        cairn_engine::transfer::install_crypto_provider();
        let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let blob = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_url = format!("http://{}", grpc.local_addr().unwrap());
        let blob_url = format!("http://{}", blob.local_addr().unwrap());
        let mut config = ServerConfig::new(data_dir);
        // SQLite in the data dir, or the PostgreSQL database CAIRN_TEST_DATABASE names.
        config.database = Some(test_location(data_dir));
        configure(&mut config);
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut coordinator = cairn_coordinator::Coordinator::open(config).await?;
            if let Some(listener) = metrics {
                coordinator = coordinator.with_metrics_listener(listener);
            }
            coordinator
                .run(grpc, blob, async {
                    let _ = stop.await;
                })
                .await
        });
        let mut server = Self {
            data_dir: data_dir.to_owned(),
            grpc_url,
            blob_url,
            admin_token: String::new(),
            shutdown: Some(shutdown),
            task: Some(task),
            owned_dir: None,
        };
        server.admin_token = server.wait_until_ready().await;
        server
    }

    pub async fn start(data_dir: &Path) -> Self {
        Self::start_with(data_dir, |_| {}).await
    }

    /// Starts a coordinator whose object store fails as `faults` says.
    pub async fn start_faulty(data_dir: &Path) -> (Self, Arc<Faults>) {
        let faults = Faults::new();
        let armed = faults.clone();
        let server = Self::start_with(data_dir, move |config| {
            config.store_layer = Some(Arc::new(move |inner: Arc<dyn ObjectStore>| {
                Arc::new(FaultyStore::new(inner, armed.clone())) as Arc<dyn ObjectStore>
            }));
        })
        .await;
        (server, faults)
    }

    /// Waits for the admin token to be written and accepted.
    async fn wait_until_ready(&mut self) -> String {
        let token_path = self.data_dir.join("admin.token");
        for _ in 0..1500 {
            if let Some(task) = &self.task
                && task.is_finished()
            {
                let result = self.task.take().unwrap().await.unwrap();
                panic!("the coordinator stopped while starting: {result:?}");
            }
            if let Ok(text) = std::fs::read_to_string(&token_path) {
                let token = text.trim().to_owned();
                if let Ok(client) = CoordinatorClient::connect(&self.grpc_url, Some(&token)).await {
                    let mut health = HealthClient::new(client.auth_channel());
                    if health
                        .check(HealthCheckRequest {
                            service: String::new(),
                        })
                        .await
                        .is_ok()
                    {
                        return token;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the coordinator did not become ready");
    }

    /// Stops the server gracefully and checks it stopped without error.
    pub async fn stop(mut self) {
        self.shutdown.take().unwrap().send(()).unwrap();
        self.task
            .take()
            .unwrap()
            .await
            .unwrap()
            .expect("the coordinator stops cleanly");
    }

    /// Keeps `dir` (its data directory) until the server is dropped.
    pub fn own_dir(&mut self, dir: tempfile::TempDir) {
        assert_eq!(dir.path(), self.data_dir);
        self.owned_dir = Some(dir);
    }

    pub async fn client(&self) -> CoordinatorClient {
        self.client_with(Some(&self.admin_token)).await
    }

    pub async fn client_with(&self, token: Option<&str>) -> CoordinatorClient {
        CoordinatorClient::connect(&self.grpc_url, token)
            .await
            .unwrap()
    }

    /// A channel that sends `token`, for any service's client.
    pub async fn channel(&self, token: &str) -> AuthChannel {
        self.client_with(Some(token)).await.auth_channel()
    }

    /// The file an object key is stored in.
    pub fn object_file(&self, key: &str) -> PathBuf {
        self.data_dir.join("blobs").join(key)
    }

    /// Files left in the blob server's upload directory.
    pub fn temp_files(&self) -> usize {
        let temp = self
            .data_dir
            .join("blobs")
            .join(cairn_coordinator::store::TEMP_DIR);
        std::fs::read_dir(temp).map(|d| d.count()).unwrap_or(0)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A fresh data directory.
pub fn data_dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Creates a workspace (optionally named) and returns it.
pub async fn create_workspace(client: &mut CoordinatorClient, name: &str) -> pb::Workspace {
    client
        .workspaces
        .create_workspace(pb::CreateWorkspaceRequest { name: name.into() })
        .await
        .unwrap()
        .into_inner()
}

/// A workspace by id or name.
pub async fn get_workspace(client: &mut CoordinatorClient, workspace: &str) -> pb::Workspace {
    client
        .workspaces
        .get_workspace(pb::GetWorkspaceRequest {
            workspace: workspace.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

pub async fn begin(client: &mut CoordinatorClient, workspace: &str) -> pb::BeginCheckpointResponse {
    client
        .checkpoints
        .begin_checkpoint(pb::BeginCheckpointRequest {
            workspace: workspace.into(),
            generation: 0,
        })
        .await
        .unwrap()
        .into_inner()
}

pub fn keys_of(begin: &pb::BeginCheckpointResponse) -> TenantKeys {
    let key = begin.key.as_ref().unwrap();
    TenantKeys::derive(key.key_id.clone(), &key.secret).unwrap()
}

/// A real pack holding `plaintexts` sealed as blobs.
pub fn build_pack(
    keys: &TenantKeys,
    kind: PackKind,
    plaintexts: &[&[u8]],
) -> FinishedPack<Vec<u8>> {
    let mut builder = PackBuilder::new(kind, Vec::new()).unwrap();
    for plaintext in plaintexts {
        let id = keys.blob_id(plaintext);
        let mut sealed = Vec::new();
        seal(keys, &id, plaintext, &mut sealed);
        builder.add(id, &sealed, plaintext.len() as u32).unwrap();
    }
    builder.finish(keys).unwrap()
}

/// Signed PUT URLs for `packs`.
pub async fn prepare(
    client: &mut CoordinatorClient,
    workspace: &str,
    packs: &[&FinishedPack<Vec<u8>>],
) -> Vec<pb::SignedUrl> {
    client
        .checkpoints
        .prepare_uploads(pb::PrepareUploadsRequest {
            workspace: workspace.into(),
            packs: packs
                .iter()
                .map(|p| pb::PackUpload {
                    pack_id: p.id.to_string(),
                    size: p.size,
                    kind: pb::PackKind::from(p.kind) as i32,
                })
                .collect(),
        })
        .await
        .unwrap()
        .into_inner()
        .urls
}

/// Uploads `packs` through signed URLs, as a runner does.
pub async fn upload(
    client: &mut CoordinatorClient,
    workspace: &str,
    packs: &[&FinishedPack<Vec<u8>>],
) {
    let urls = prepare(client, workspace, packs).await;
    let http = reqwest::Client::new();
    for (url, pack) in urls.iter().zip(packs) {
        assert_eq!(url.pack_id, pack.id.to_string());
        // The headers the URL was signed with (S3's checksum), as a runner sends them.
        let mut request = http.put(&url.url);
        for (name, value) in &url.headers {
            request = request.header(name, value);
        }
        let response = request.body(pack.sink.clone()).send().await.unwrap();
        // 200 from the embedded store and S3, 201 from Azure.
        let status = response.status();
        assert!(
            status.is_success(),
            "{status}: {}",
            response.text().await.unwrap()
        );
    }
}

pub fn new_pack(pack: &FinishedPack<Vec<u8>>) -> pb::NewPack {
    pb::NewPack {
        pack_id: pack.id.to_string(),
        kind: pb::PackKind::from(pack.kind) as i32,
        size: pack.size,
        index_offset: pack.index_offset,
        index_length: pack.index_length,
        blob_ids: pack
            .blob_ids
            .iter()
            .map(|b| b.as_bytes().to_vec())
            .collect(),
    }
}

/// A commit whose root tree is the first blob of `root_pack`.
pub fn commit_request(
    begin: &pb::BeginCheckpointResponse,
    root_pack: &FinishedPack<Vec<u8>>,
    new_packs: &[&FinishedPack<Vec<u8>>],
    referenced: &[&FinishedPack<Vec<u8>>],
) -> pb::CommitCheckpointRequest {
    pb::CommitCheckpointRequest {
        workspace: begin.workspace_id.clone(),
        generation: begin.generation,
        parent_checkpoint_id: begin.parent_checkpoint_id.clone(),
        reason: pb::CheckpointReason::Manual as i32,
        format_version: 1,
        root_tree: root_pack.blob_ids[0].as_bytes().to_vec(),
        new_packs: new_packs.iter().map(|p| new_pack(p)).collect(),
        referenced_packs: referenced.iter().map(|p| p.id.to_string()).collect(),
        stats: Some(pb::CheckpointStats {
            files: 1,
            ..Default::default()
        }),
        key_id: begin.key.as_ref().unwrap().key_id.clone(),
        ..Default::default()
    }
}

/// Commits a checkpoint that must be accepted.
pub async fn commit(
    client: &mut CoordinatorClient,
    request: pb::CommitCheckpointRequest,
) -> pb::Checkpoint {
    client
        .checkpoints
        .commit_checkpoint(request)
        .await
        .unwrap()
        .into_inner()
}

/// Commits a checkpoint that must be refused; returns why.
pub async fn commit_err(
    client: &mut CoordinatorClient,
    request: pb::CommitCheckpointRequest,
) -> tonic::Status {
    client
        .checkpoints
        .commit_checkpoint(request)
        .await
        .unwrap_err()
}

/// One whole checkpoint of `contents`: a meta pack with a root tree blob and
/// a data pack, uploaded and committed.
pub async fn checkpoint(
    client: &mut CoordinatorClient,
    workspace: &str,
    contents: &[u8],
) -> pb::Checkpoint {
    let begin = begin(client, workspace).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[&[b"tree of ", contents].concat()]);
    let data = build_pack(&keys, PackKind::Data, &[contents]);
    upload(client, workspace, &[&meta, &data]).await;
    let both = [&meta, &data];
    commit(client, commit_request(&begin, &meta, &both, &both)).await
}

/// Every checkpoint of a workspace, newest first.
pub async fn list_checkpoints(
    client: &mut CoordinatorClient,
    workspace: &str,
) -> Vec<pb::Checkpoint> {
    client
        .checkpoints
        .list_checkpoints(pb::ListCheckpointsRequest {
            workspace: workspace.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .checkpoints
}

/// The manifest of a workspace's newest checkpoints.
pub async fn manifest(
    client: &mut CoordinatorClient,
    workspace: &str,
    checkpoint_id: &str,
) -> pb::RestoreManifest {
    client
        .checkpoints
        .get_restore_manifest(pb::GetRestoreManifestRequest {
            workspace: workspace.into(),
            checkpoint_id: checkpoint_id.into(),
            max_candidates: 0,
        })
        .await
        .unwrap()
        .into_inner()
}
