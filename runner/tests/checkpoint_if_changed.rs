//! `checkpoint_if_changed` against a real coordinator: an unchanged
//! workspace commits nothing, a change commits, and a baseline that is no
//! longer the newest checkpoint never suppresses a commit; a resident
//! runner, which keeps its connection, goes on across a coordinator restart.
//!
//! Needs the `cairn-coordinator` binary next to this test's target dir
//! (`cargo build -p cairn-coordinator`); without it the test says so and
//! passes vacuously — the end-to-end suite builds and runs everything.

mod attempt_support;

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use attempt_support::{coordinator_binary, start_coordinator, start_coordinator_on};

use cairn_engine::checkpoint::{self, Baseline, CheckpointOptions, Resident};
use cairn_engine::client::CoordinatorClient;
use cairn_engine::git::narrow::ReadBy;
use cairn_engine::tracker::ChangeTracker;
use cairn_proto::domain::CheckpointReason;
use cairn_proto::pb;

async fn create_workspace(grpc: &str, token: &str, name: &str) -> String {
    let coordinator = CoordinatorClient::connect(grpc, Some(token)).await.unwrap();
    coordinator
        .workspaces
        .clone()
        .create_workspace(pb::CreateWorkspaceRequest { name: name.into() })
        .await
        .unwrap()
        .into_inner()
        .id
}

fn options(
    grpc: &str,
    token: &str,
    workspace: String,
    root: &Path,
    cache: &Path,
) -> CheckpointOptions {
    CheckpointOptions {
        coordinator: grpc.to_owned(),
        token: Some(token.to_owned()),
        workspace,
        root: root.to_owned(),
        reason: CheckpointReason::Interval,
        cache_dir: cache.to_owned(),
        skip_ignored: false,
        excludes: vec![],
        generation: None,
        harness: None,
        limits: Default::default(),
        resident: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_changed_workspace_is_committed() {
    let binary = coordinator_binary();
    let dir = tempfile::tempdir().unwrap();
    let (_server, grpc, token) =
        start_coordinator(&binary, &dir.path().join("data"), Duration::from_secs(60));
    let workspace = create_workspace(&grpc, &token, "if-changed").await;
    let root = dir.path().join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("a.txt"), "one\n").unwrap();
    let first_mtime = fs::metadata(root.join("a.txt"))
        .unwrap()
        .modified()
        .unwrap();
    let opts = options(&grpc, &token, workspace, &root, &dir.path().join("cache"));
    let first = checkpoint::checkpoint(opts.clone()).await.unwrap();
    let baseline = Baseline {
        checkpoint_id: first.checkpoint_id.clone(),
        root_tree: first.root_tree,
    };

    let unchanged = checkpoint::checkpoint_if_changed(opts.clone(), &baseline)
        .await
        .unwrap();
    assert!(unchanged.is_none(), "nothing changed, nothing committed");

    fs::write(root.join("a.txt"), "two\n").unwrap();
    let changed = checkpoint::checkpoint_if_changed(opts.clone(), &baseline)
        .await
        .unwrap()
        .expect("a change commits");
    assert_eq!(
        changed.sequence,
        first.sequence + 1,
        "the skipped one took no sequence number"
    );
    assert_ne!(changed.root_tree, first.root_tree);

    // Back to the first content and mtime: equal to the baseline's tree,
    // but the baseline is no longer the newest checkpoint, so this commits.
    fs::write(root.join("a.txt"), "one\n").unwrap();
    fs::File::options()
        .write(true)
        .open(root.join("a.txt"))
        .unwrap()
        .set_modified(first_mtime)
        .unwrap();
    let reverted = checkpoint::checkpoint_if_changed(opts, &baseline)
        .await
        .unwrap()
        .expect("committed");
    assert_eq!(
        reverted.root_tree, first.root_tree,
        "equal content, equal root tree"
    );
    assert_eq!(reverted.sequence, changed.sequence + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resident_runner_goes_on_across_a_coordinator_restart() {
    let binary = coordinator_binary();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (server, grpc, token) = start_coordinator(&binary, &data, Duration::from_secs(60));
    let workspace = create_workspace(&grpc, &token, "restarted").await;
    let root = dir.path().join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("a.txt"), "one\n").unwrap();
    let tracker = ChangeTracker::start(&root, Duration::from_secs(3600)).unwrap();
    let opts = CheckpointOptions {
        resident: Some(Arc::new(Resident::new(Some(tracker)))),
        ..options(&grpc, &token, workspace, &root, &dir.path().join("cache"))
    };
    let first = checkpoint::checkpoint(opts.clone()).await.unwrap();
    let baseline = Baseline {
        checkpoint_id: first.checkpoint_id.clone(),
        root_tree: first.root_tree,
    };

    // The same address and data dir: what a restarted coordinator is.
    drop(server);
    fs::remove_file(data.join("endpoints.json")).unwrap();
    let listen = grpc.trim_start_matches("http://");
    let (_server, again, _) = start_coordinator_on(&binary, &data, listen, Duration::from_secs(60));
    assert_eq!(again, grpc);

    let unchanged = checkpoint::checkpoint_if_changed(opts.clone(), &baseline)
        .await
        .expect("the runner's kept connection reaches the restarted coordinator");
    assert!(unchanged.is_none(), "nothing changed, nothing committed");
    fs::write(root.join("a.txt"), "two\n").unwrap();
    let changed = checkpoint::checkpoint_if_changed(opts, &baseline)
        .await
        .unwrap()
        .expect("a change commits");
    assert_eq!(changed.sequence, first.sequence + 1);
}

fn git(dir: &Path, args: &[&str]) {
    let status = std::process::Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .current_dir(dir)
        .status()
        .unwrap();
    assert!(status.success(), "git {args:?}");
}

/// A coordinator, a workspace holding one committed repository `app`, and
/// a resident runner's options for it; nothing checkpointed yet.
struct ResidentRepo {
    root: std::path::PathBuf,
    resident: Arc<Resident>,
    opts: CheckpointOptions,
    _server: attempt_support::Reaped,
    _dir: tempfile::TempDir,
}

async fn resident_repo(binary: &Path, name: &str) -> ResidentRepo {
    let dir = tempfile::tempdir().unwrap();
    let (server, grpc, token) =
        start_coordinator(binary, &dir.path().join("data"), Duration::from_secs(60));
    let workspace = create_workspace(&grpc, &token, name).await;
    let root = fs::canonicalize(dir.path()).unwrap().join("root");
    let app = root.join("app");
    fs::create_dir_all(app.join("src")).unwrap();
    fs::write(app.join("src/lib.rs"), "one\n").unwrap();
    git(&app, &["init", "-q"]);
    git(&app, &["add", "."]);
    git(&app, &["commit", "-qm", "first"]);
    let tracker = ChangeTracker::start(&root, Duration::from_secs(3600)).unwrap();
    let resident = Arc::new(Resident::new(Some(tracker)));
    let opts = CheckpointOptions {
        resident: Some(resident.clone()),
        ..options(&grpc, &token, workspace, &root, &dir.path().join("cache"))
    };
    ResidentRepo {
        root,
        resident,
        opts,
        _server: server,
        _dir: dir,
    }
}

/// How the runner last read `app`'s status, and how many narrowed readings
/// in a row that was.
fn app_status(resident: &Resident) -> (ReadBy, u32) {
    let memory = resident.status_memory().expect("a status is remembered");
    let app = &memory.repos[&b"app"[..]];
    (app.read_by, app.narrowed)
}

/// A resident runner with nothing to narrow from reads each repository in
/// full once, and remembers it: the checkpoint after asks only about what
/// changed since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resident_runners_first_reading_of_a_repository_narrows_the_next() {
    let binary = coordinator_binary();
    let ResidentRepo {
        root,
        resident,
        opts,
        ..
    } = &resident_repo(&binary, "first-reading").await;
    let first = checkpoint::checkpoint(opts.clone()).await.unwrap();
    assert_eq!(first.repos.len(), 1);
    assert_eq!(app_status(resident), (ReadBy::FullGit, 0));

    fs::write(root.join("app/src/lib.rs"), "two\n").unwrap();
    let second = checkpoint::checkpoint(opts.clone()).await.unwrap();
    let (read_by, narrowed) = app_status(resident);
    assert_ne!(read_by, ReadBy::FullGit, "narrowed from the first reading");
    assert_eq!(narrowed, 1);
    assert_eq!(second.repos[0].unstaged, 1, "src/lib.rs");
}

/// A checkpoint that comes while the runner's first background reading of
/// the repositories goes on waits for it and narrows its own from it,
/// rather than reading every repository in full beside it. (The reading, a
/// `git status` process, is still going when the checkpoint starts in all
/// but the slowest of schedulers; when it has ended, the checkpoint
/// narrows from it all the same.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_during_the_runners_first_status_reading_narrows_from_it() {
    let binary = coordinator_binary();
    let ResidentRepo {
        root,
        resident,
        opts,
        ..
    } = &resident_repo(&binary, "during-reading").await;
    let walk_options = opts.scan_options(root, &opts.cache_dir);
    let (walk, _) = resident
        .tracker()
        .unwrap()
        .scan(&walk_options, &|_| {})
        .unwrap();
    fs::write(root.join("app/src/lib.rs"), "two\n").unwrap();
    resident.read_repos_after(walk);

    let first = checkpoint::checkpoint(opts.clone()).await.unwrap();
    let (read_by, narrowed) = app_status(resident);
    assert_ne!(
        read_by,
        ReadBy::FullGit,
        "narrowed from the runner's reading"
    );
    assert_eq!(narrowed, 1);
    assert_eq!(first.repos[0].unstaged, 1, "src/lib.rs");
}
