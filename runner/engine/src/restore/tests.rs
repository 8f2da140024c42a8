//! Restore tests against packs built in memory and served by a tiny HTTP
//! store (no coordinator): fidelity, hostile trees, reuse, reconciliation,
//! fallback, URL refresh.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, CheckpointId, PackId, WorkspaceId};
use cairn_proto::pb;
use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::format::{ChunkRef, Entry, EntryKind, PackBuilder, TenantKeys, Tree, seal};

const SECRET: [u8; 32] = [42; 32];
const MTIME: i64 = 1_600_000_000;

/// Objects served over HTTP/1.1 with `Range` support. A URL whose query
/// contains `sig=expired` gets a 403, as an expired signed URL would.
#[derive(Default)]
struct TestStore {
    objects: Mutex<HashMap<String, Vec<u8>>>,
    ranged_gets: Mutex<Vec<String>>,
    /// Every request answered, whole or ranged.
    requests: AtomicUsize,
}

impl TestStore {
    async fn start() -> (Arc<Self>, String) {
        let store = Arc::new(Self::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let serving = store.clone();
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                let store = serving.clone();
                tokio::spawn(async move { store.answer(socket).await });
            }
        });
        (store, base)
    }

    async fn answer(&self, mut socket: tokio::net::TcpStream) {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if socket.read(&mut byte).await.unwrap_or(0) == 0 {
                return;
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        self.requests.fetch_add(1, Ordering::SeqCst);
        let target = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let range = head.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("range")
                .then(|| value.trim().to_owned())
        });
        let (status, body) = if query.contains("sig=expired") {
            ("403 Forbidden", Vec::new())
        } else {
            match self.objects.lock().unwrap().get(path) {
                None => ("404 Not Found", Vec::new()),
                Some(bytes) => match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
                    Some(spec) => {
                        self.ranged_gets
                            .lock()
                            .unwrap()
                            .push(format!("{path} {spec}"));
                        let (a, b) = spec.split_once('-').unwrap();
                        let a: usize = a.parse().unwrap();
                        let b: usize = b.parse::<usize>().unwrap().min(bytes.len() - 1);
                        ("206 Partial Content", bytes[a..=b].to_vec())
                    }
                    None => ("200 OK", bytes.clone()),
                },
            }
        };
        let header = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let _ = socket.write_all(header.as_bytes()).await;
        let _ = socket.write_all(&body).await;
        let _ = socket.shutdown().await;
    }

    fn data_requests(&self, packs: &[PackId]) -> usize {
        let names: Vec<String> = packs.iter().map(|p| format!("/packs/{p} ")).collect();
        self.ranged_gets
            .lock()
            .unwrap()
            .iter()
            .filter(|r| names.iter().any(|n| r.starts_with(n.as_str())))
            // Header (0-15) and index reads are not content.
            .filter(|r| !r.ends_with(" 0-15"))
            .count()
    }
}

/// Builds one checkpoint's packs.
struct Build {
    keys: TenantKeys,
    meta: PackBuilder<Vec<u8>>,
    data: PackBuilder<Vec<u8>>,
    finished_data: Vec<crate::format::FinishedPack<Vec<u8>>>,
    sealed: HashSet<BlobId>,
    /// When the checkpoint's scan began, as its record says (`None`: it does not).
    scan_started: Option<SystemTime>,
}

fn entry(name: &[u8], kind: EntryKind, mode: u32) -> Entry {
    Entry {
        name: name.to_vec(),
        kind,
        mode,
        mtime_sec: MTIME,
        mtime_nsec: 250,
        uid: 0,
        gid: 0,
    }
}

impl Build {
    fn new() -> Self {
        Self {
            keys: TenantKeys::derive("k1", &SECRET).unwrap(),
            meta: PackBuilder::new(PackKind::Meta, Vec::new()).unwrap(),
            data: PackBuilder::new(PackKind::Data, Vec::new()).unwrap(),
            finished_data: Vec::new(),
            sealed: HashSet::new(),
            scan_started: None,
        }
    }

    /// Seals a chunk into the current DATA pack (once per build).
    fn chunk(&mut self, bytes: &[u8]) -> ChunkRef {
        let id = self.keys.blob_id(bytes);
        if self.sealed.insert(id) {
            let mut sealed = Vec::new();
            seal(&self.keys, &id, bytes, &mut sealed);
            self.data.add(id, &sealed, bytes.len() as u32).unwrap();
        }
        ChunkRef {
            id,
            len: bytes.len() as u32,
        }
    }

    /// Starts another DATA pack.
    fn next_data_pack(&mut self) {
        let full = std::mem::replace(
            &mut self.data,
            PackBuilder::new(PackKind::Data, Vec::new()).unwrap(),
        );
        self.finished_data.push(full.finish(&self.keys).unwrap());
    }

    fn file_of(&mut self, name: &str, chunks: Vec<ChunkRef>, mode: u32) -> Entry {
        let size = chunks.iter().map(|c| u64::from(c.len)).sum();
        entry(name.as_bytes(), EntryKind::File { size, chunks }, mode)
    }

    fn file(&mut self, name: &str, content: &[u8], mode: u32) -> Entry {
        let chunks = if content.is_empty() {
            Vec::new()
        } else {
            vec![self.chunk(content)]
        };
        self.file_of(name, chunks, mode)
    }

    fn tree(&mut self, mut entries: Vec<Entry>) -> BlobId {
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        self.raw_tree(entries)
    }

    /// A tree exactly as given (hostile trees are unsorted or duplicated on purpose).
    fn raw_tree(&mut self, entries: Vec<Entry>) -> BlobId {
        let bytes = Tree { entries }.encode();
        let id = self.keys.blob_id(&bytes);
        let mut sealed = Vec::new();
        seal(&self.keys, &id, &bytes, &mut sealed);
        self.meta.add(id, &sealed, bytes.len() as u32).unwrap();
        id
    }

    fn dir(&mut self, name: &str, entries: Vec<Entry>) -> Entry {
        let tree = self.tree(entries);
        entry(name.as_bytes(), EntryKind::Dir { tree }, 0o750)
    }

    /// Finishes the packs, puts them in the store and returns the candidate.
    fn publish(mut self, fixture: &Fixture, root: BlobId) -> Published {
        self.next_data_pack();
        let meta = self.meta.finish(&self.keys).unwrap();
        let mut packs = Vec::new();
        let mut data_packs = Vec::new();
        for pack in std::iter::once(meta).chain(self.finished_data) {
            if pack.kind == PackKind::Data {
                data_packs.push(pack.id.clone());
            }
            packs.push(pack.id.clone());
            fixture.locations.lock().unwrap().push(pb::PackLocation {
                pack_id: pack.id.to_string(),
                kind: pb::PackKind::from(pack.kind) as i32,
                size: pack.size,
                index_offset: pack.index_offset,
                index_length: pack.index_length,
                url: String::new(),
            });
            fixture
                .store
                .objects
                .lock()
                .unwrap()
                .insert(format!("/packs/{}", pack.id), pack.sink);
        }
        let id = CheckpointId::generate();
        let sequence = fixture.candidates.lock().unwrap().len() as u64 + 1;
        let candidate = pb::RestoreCandidate {
            checkpoint: Some(pb::Checkpoint {
                id: id.to_string(),
                sequence,
                root_tree: root.as_bytes().to_vec(),
                key_id: "k1".into(),
                format_version: 1,
                reason: pb::CheckpointReason::Manual as i32,
                stats: self.scan_started.map(|t| pb::CheckpointStats {
                    scan_started_at: Some(cairn_proto::domain::to_timestamp(t)),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            packs: packs.iter().map(|p| p.to_string()).collect(),
        };
        fixture.candidates.lock().unwrap().insert(0, candidate);
        Published {
            id,
            packs,
            data_packs,
        }
    }
}

struct Published {
    id: CheckpointId,
    packs: Vec<PackId>,
    data_packs: Vec<PackId>,
}

/// A workspace's checkpoints, served like a coordinator would.
struct Fixture {
    store: Arc<TestStore>,
    base: String,
    workspace: WorkspaceId,
    candidates: Mutex<Vec<pb::RestoreCandidate>>,
    locations: Mutex<Vec<pb::PackLocation>>,
    /// The signature part of URLs for each manifest call (the last repeats).
    signatures: Mutex<Vec<&'static str>>,
    calls: AtomicUsize,
}

impl Fixture {
    async fn new() -> Self {
        let (store, base) = TestStore::start().await;
        Self {
            store,
            base,
            workspace: WorkspaceId::generate(),
            candidates: Mutex::new(Vec::new()),
            locations: Mutex::new(Vec::new()),
            signatures: Mutex::new(vec!["sig=ok"]),
            calls: AtomicUsize::new(0),
        }
    }

    fn pack_bytes(&self, pack: &PackId) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        let guard = self.store.objects.lock().unwrap();
        assert!(guard.contains_key(&format!("/packs/{pack}")));
        guard
    }

    fn corrupt_first_blob(&self, pack: &PackId) {
        let keys = TenantKeys::derive("k1", &SECRET).unwrap();
        let mut objects = self.pack_bytes(pack);
        let bytes = objects.get_mut(&format!("/packs/{pack}")).unwrap();
        let size = bytes.len() as u64;
        let tail = &bytes[bytes.len() - crate::format::PACK_TRAILER_LEN..];
        let (offset, length) = crate::format::parse_trailer(pack, size, tail).unwrap();
        let index = PackIndex::open(
            &keys,
            pack,
            PackKind::Data,
            offset,
            &bytes[offset as usize..(offset + u64::from(length)) as usize],
        )
        .unwrap();
        let victim = index.entries[0];
        bytes[(victim.offset + u64::from(victim.sealed_len) / 2) as usize] ^= 0x20;
    }

    fn options(&self, root: &Path) -> RestoreOptions {
        RestoreOptions::new(root, "my-workspace")
    }
}

impl ManifestSource for Fixture {
    fn restore_manifest(
        &self,
        request: pb::GetRestoreManifestRequest,
    ) -> BoxFuture<'_, Result<pb::RestoreManifest, tonic::Status>> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let signatures = self.signatures.lock().unwrap().clone();
        let signature = signatures[call.min(signatures.len() - 1)];
        let mut candidates = self.candidates.lock().unwrap().clone();
        if !request.checkpoint_id.is_empty() {
            candidates.retain(|c| c.checkpoint.as_ref().unwrap().id == request.checkpoint_id);
        }
        let packs = self
            .locations
            .lock()
            .unwrap()
            .iter()
            .map(|l| pb::PackLocation {
                url: format!("{}/packs/{}?{signature}", self.base, l.pack_id),
                ..l.clone()
            })
            .collect();
        let manifest = pb::RestoreManifest {
            workspace_id: self.workspace.to_string(),
            tenant: "default".into(),
            keys: vec![pb::TenantKey {
                key_id: "k1".into(),
                secret: SECRET.to_vec(),
            }],
            candidates,
            packs,
            urls_expire_at: None,
        };
        Box::pin(async move { Ok(manifest) })
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = match fs::read_dir(dir) {
        Ok(listing) => listing
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    names
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

fn big_content() -> Vec<Vec<u8>> {
    (0..6u8)
        .map(|i| vec![b'a' + i; 3000 + usize::from(i)])
        .collect()
}

/// A small workspace: text, an executable, an empty file, an empty dir,
/// symlinks, and a multi-chunk file whose chunks lie in two packs in reverse
/// order (one chunk twice, one shared with another file).
fn sample(fixture: &Fixture) -> Published {
    sample_scanned(fixture, None)
}

/// [`sample`], with the time its checkpoint's scan began in the record.
fn sample_scanned(fixture: &Fixture, scan_started: Option<SystemTime>) -> Published {
    let mut b = Build::new();
    b.scan_started = scan_started;
    let parts = big_content();
    let mut refs: Vec<ChunkRef> = parts.iter().rev().take(3).map(|p| b.chunk(p)).collect();
    b.next_data_pack();
    refs.extend(parts.iter().rev().skip(3).map(|p| b.chunk(p)));
    refs.reverse();
    refs.push(refs[1]);
    // Read-only, in several chunks: later chunks reopen it for writing.
    let big = b.file_of("big.bin", refs.clone(), 0o444);
    // Bits a usual umask (022) takes from a newly created file.
    let shared = b.file_of("shared.bin", vec![refs[2]], 0o664);
    let readme = b.file("README.md", b"hello\n", 0o644);
    let run = b.file("run.sh", b"#!/bin/sh\necho hi\n", 0o4755);
    let bin = b.dir("bin", vec![run]);
    let empty = b.file("empty", b"", 0o400);
    let empty_dir = b.dir("empty dir", vec![]);
    let link = entry(
        b"link",
        EntryKind::Symlink {
            target: b"README.md".to_vec(),
        },
        0o777,
    );
    let dangling = entry(
        b"dangling",
        EntryKind::Symlink {
            target: b"../nowhere".to_vec(),
        },
        0o777,
    );
    let nested = b.file("n\u{e4}me with space.txt", b"nested\n", 0o640);
    let deep = b.dir("deep", vec![nested]);
    let src = b.dir("src", vec![deep, big]);
    let root = b.tree(vec![
        readme, bin, empty, empty_dir, link, dangling, src, shared,
    ]);
    b.publish(fixture, root)
}

fn assert_sample(root: &Path) {
    let parts = big_content();
    let mut big: Vec<u8> = parts.concat();
    big.extend_from_slice(&parts[1]);
    assert_eq!(fs::read(root.join("src/big.bin")).unwrap(), big);
    assert_eq!(fs::read(root.join("shared.bin")).unwrap(), parts[2]);
    assert_eq!(fs::read(root.join("README.md")).unwrap(), b"hello\n");
    assert_eq!(
        fs::read(root.join("src/deep/n\u{e4}me with space.txt")).unwrap(),
        b"nested\n"
    );
    assert_eq!(fs::read(root.join("empty")).unwrap(), b"");
    assert_eq!(mode(&root.join("bin/run.sh")), 0o4755);
    assert_eq!(mode(&root.join("empty")), 0o400);
    assert_eq!(mode(&root.join("src/big.bin")), 0o444);
    assert_eq!(mode(&root.join("shared.bin")), 0o664);
    assert_eq!(mode(&root.join("src")), 0o750);
    assert_eq!(names(&root.join("empty dir")), Vec::<String>::new());
    assert_eq!(
        fs::read_link(root.join("link")).unwrap(),
        Path::new("README.md")
    );
    assert_eq!(
        fs::read_link(root.join("dangling")).unwrap(),
        Path::new("../nowhere")
    );
    for path in [
        "README.md",
        "src",
        "src/deep",
        "bin",
        "src/big.bin",
        "empty dir",
        "link",
        "dangling",
    ] {
        let meta = fs::symlink_metadata(root.join(path)).unwrap();
        assert_eq!(
            (meta.mtime(), meta.mtime_nsec()),
            (MTIME, 250),
            "mtime of {path}"
        );
    }
    let listed: Vec<String> = names(root).into_iter().filter(|n| n != ".cache").collect();
    assert_eq!(
        listed,
        [
            "README.md",
            "bin",
            "dangling",
            "empty",
            "empty dir",
            "link",
            "shared.bin",
            "src"
        ]
    );
}

#[tokio::test]
async fn a_checkpoint_is_restored_with_contents_modes_links_and_mtimes() {
    let fixture = Fixture::new().await;
    let published = sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("new/root");

    let report = restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap();
    assert_sample(&root);
    assert_eq!(report.checkpoint_id, published.id);
    assert_eq!(report.workspace_id, fixture.workspace);
    assert!(report.fell_back_from.is_empty());
    assert_eq!(
        (report.files, report.directories, report.symlinks),
        (6, 4, 2)
    );
    assert_eq!(report.files_reused, 0);
    let big: u64 = big_content().iter().map(|p| p.len() as u64).sum::<u64>() + 3001;
    assert_eq!(report.bytes_written, big + 3002 + 6 + 18 + 7);
    assert!(report.bytes_downloaded > 0);
    let json = report.to_json();
    for key in [
        "checkpoint_id",
        "workspace_id",
        "fell_back_from",
        "files",
        "directories",
        "symlinks",
        "bytes_written",
        "bytes_downloaded",
        "files_reused",
        "duration_ms",
    ] {
        assert!(json.get(key).is_some(), "{key} missing from {json}");
    }
}

/// A hostile tree: a label, how to build it, words its refusal must contain (any one).
type HostileCase = (
    &'static str,
    Box<dyn Fn(&mut Build) -> BlobId>,
    &'static [&'static str],
);

fn hostile_cases() -> Vec<HostileCase> {
    fn root_with(b: &mut Build, bad: Entry) -> BlobId {
        let ok = b.file("ok.txt", b"fine\n", 0o644);
        b.tree(vec![bad, ok])
    }
    vec![
        (
            "dot-dot file",
            Box::new(|b: &mut Build| {
                let e = b.file("../x", b"escape\n", 0o644);
                root_with(b, e)
            }),
            &["../x"],
        ),
        (
            "dot-dot dir",
            Box::new(|b: &mut Build| {
                let e = b.dir("..", vec![]);
                root_with(b, e)
            }),
            &["\"..\"", "relative directory"],
        ),
        (
            "absolute name",
            Box::new(|b: &mut Build| {
                let e = b.file("/tmp/abs", b"x", 0o644);
                root_with(b, e)
            }),
            &["/tmp/abs"],
        ),
        (
            "slash inside",
            Box::new(|b: &mut Build| {
                let e = b.file("a/b", b"x", 0o644);
                root_with(b, e)
            }),
            &["a/b", "'/'"],
        ),
        (
            "NUL",
            Box::new(|b: &mut Build| {
                let e = b.file("a\0b", b"x", 0o644);
                root_with(b, e)
            }),
            &["nul"],
        ),
        (
            "symlink and dir of one name",
            Box::new(|b: &mut Build| {
                let inner = b.file("f", b"through a link\n", 0o644);
                let dir = b.dir("a", vec![inner]);
                let link = entry(
                    b"a",
                    EntryKind::Symlink {
                        target: b"/tmp".to_vec(),
                    },
                    0o777,
                );
                b.raw_tree(vec![link, dir])
            }),
            &["twice"],
        ),
        (
            "fifo",
            Box::new(|b: &mut Build| root_with(b, entry(b"fifo", EntryKind::Fifo, 0o644))),
            &["fifo"],
        ),
        (
            "char device",
            Box::new(|b: &mut Build| root_with(b, entry(b"tty", EntryKind::CharDevice, 0o644))),
            &["character device"],
        ),
        (
            "socket",
            Box::new(|b: &mut Build| root_with(b, entry(b"sock", EntryKind::Socket, 0o644))),
            &["socket"],
        ),
        (
            "empty link target",
            Box::new(|b: &mut Build| {
                root_with(
                    b,
                    entry(b"link", EntryKind::Symlink { target: Vec::new() }, 0o777),
                )
            }),
            &["symlink target"],
        ),
        (
            "oversized file",
            Box::new(|b: &mut Build| {
                let chunk = b.chunk(&[7u8; 4096]);
                let e = b.file_of("big", vec![chunk; 300], 0o644);
                root_with(b, e)
            }),
            &["\"big\"", "limit"],
        ),
        (
            "deep nesting",
            Box::new(|b: &mut Build| {
                let mut tree = b.tree(vec![]);
                for _ in 0..40 {
                    tree = b.tree(vec![entry(b"d", EntryKind::Dir { tree }, 0o755)]);
                }
                tree
            }),
            &["nested deeper"],
        ),
        (
            "unsorted",
            Box::new(|b: &mut Build| {
                let z = b.file("z", b"z", 0o644);
                let a = b.file("a", b"a", 0o644);
                b.raw_tree(vec![z, a])
            }),
            &["sorted"],
        ),
    ]
}

#[tokio::test]
async fn hostile_trees_are_refused_by_name_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let sandbox = tmp.path().join("sandbox");
    let root = sandbox.join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("keep.txt"), b"before\n").unwrap();
    let cache = tmp.path().join("cache");
    for (label, make, words) in hostile_cases() {
        let fixture = Fixture::new().await;
        let mut b = Build::new();
        let tree = make(&mut b);
        let published = b.publish(&fixture, tree);
        let opts = RestoreOptions {
            checkpoint: Some(published.id.clone()),
            cache_dir: Some(cache.clone()),
            tree_bounds: TreeBounds {
                max_file_size: 1 << 20,
                max_depth: 32,
                ..TreeBounds::default()
            },
            ..fixture.options(&root)
        };
        let err = restore(&fixture, &opts, &NoProgress).await.unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, RestoreError::NothingRestorable { .. }),
            "{label}: {message}"
        );
        assert!(
            message.contains(published.id.as_str()),
            "{label}: {message}"
        );
        assert!(
            words
                .iter()
                .any(|w| message.to_lowercase().contains(&w.to_lowercase())),
            "{label}: expected one of {words:?} in {message}"
        );
        assert_eq!(
            names(&sandbox),
            ["root"],
            "{label}: something was written beside the root"
        );
        assert_eq!(names(&root), ["keep.txt"], "{label}: the root was touched");
        assert_eq!(fs::read(root.join("keep.txt")).unwrap(), b"before\n");
    }
    assert!(
        !cache.exists(),
        "a refused restore does not write the cache"
    );
}

#[tokio::test]
async fn existing_symlinks_and_hard_links_in_the_root_are_replaced_not_written_through() {
    let fixture = Fixture::new().await;
    let mut b = Build::new();
    let f = b.file("f.txt", b"inside a\n", 0o644);
    let sub_file = b.file("g.txt", b"deeper\n", 0o644);
    let sub = b.dir("sub", vec![sub_file]);
    let a = b.dir("a", vec![f, sub]);
    let file = b.file("b.txt", b"planned b\n", 0o644);
    let linked = b.file("h.txt", b"planned h\n", 0o644);
    let root_tree = b.tree(vec![a, file, linked]);
    b.publish(&fixture, root_tree);

    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let outside_file = tmp.path().join("outside.txt");
    fs::write(&outside_file, b"untouched\n").unwrap();
    let hard = tmp.path().join("hard.txt");
    fs::write(&hard, b"original!\n").unwrap();
    let root = tmp.path().join("root");
    fs::create_dir(&root).unwrap();
    symlink(&outside, root.join("a")).unwrap();
    symlink(&outside_file, root.join("b.txt")).unwrap();
    fs::hard_link(&hard, root.join("h.txt")).unwrap();

    restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap();
    assert!(
        names(&outside).is_empty(),
        "written through the symlink a: {:?}",
        names(&outside)
    );
    assert_eq!(fs::read(&outside_file).unwrap(), b"untouched\n");
    assert_eq!(
        fs::read(&hard).unwrap(),
        b"original!\n",
        "written through a hard link"
    );
    assert!(fs::symlink_metadata(root.join("a")).unwrap().is_dir());
    assert_eq!(fs::read(root.join("a/sub/g.txt")).unwrap(), b"deeper\n");
    assert_eq!(fs::read(root.join("b.txt")).unwrap(), b"planned b\n");
    assert_eq!(fs::read(root.join("h.txt")).unwrap(), b"planned h\n");
    assert_eq!(
        names(tmp.path()),
        ["hard.txt", "outside", "outside.txt", "root"]
    );
}

#[tokio::test]
async fn matching_files_are_reused_stale_ones_rewritten_and_extras_removed() {
    let fixture = Fixture::new().await;
    let published = sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let cache_dir = root.join(".cache/cairn");
    let opts = RestoreOptions {
        cache_dir: Some(cache_dir.clone()),
        ..fixture.options(&root)
    };
    restore(&fixture, &opts, &NoProgress).await.unwrap();
    assert!(
        cache_dir.is_dir(),
        "the cache was saved inside the root and survived the extras pass"
    );
    let cache = FingerprintCache::load(&cache_dir, &fixture.workspace, "k1");
    let cached = cache
        .file(b"src/big.bin")
        .expect("restored files are in the fingerprint cache");
    assert_eq!(cached.chunks.len(), 7);
    assert_eq!(
        cache.blob_pack(&cached.chunks[0].id),
        Some(&published.data_packs[1])
    );
    let inode = |p: &str| fs::symlink_metadata(root.join(p)).unwrap().ino();
    let before = (inode("src/big.bin"), inode("README.md"));

    // Same size, other content: must be rewritten. Mode drift: fixed in place.
    fs::write(root.join("shared.bin"), vec![b'z'; 3002]).unwrap();
    fs::set_permissions(root.join("bin/run.sh"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(root.join("stray.txt"), b"not in the checkpoint").unwrap();
    fs::create_dir_all(root.join("src/junk/deeper")).unwrap();
    symlink("/etc", root.join("bin/etc-link")).unwrap();
    fs::remove_file(root.join("link")).unwrap();
    fs::create_dir(root.join("link")).unwrap();
    fs::write(root.join("link/inside"), b"x").unwrap();
    let data_requests_before = fixture.store.data_requests(&published.data_packs);

    let report = restore(&fixture, &opts, &NoProgress).await.unwrap();
    assert_sample(&root);
    assert_eq!(report.files_reused, 5, "all but shared.bin are reused");
    assert_eq!(report.bytes_written, 3002);
    assert_eq!(report.entries_removed, 3);
    assert_eq!(
        (inode("src/big.bin"), inode("README.md")),
        before,
        "reused files are not rewritten"
    );
    let data_requests = fixture.store.data_requests(&published.data_packs) - data_requests_before;
    // Two index reads plus the one range holding shared.bin's chunk.
    assert_eq!(
        data_requests,
        3,
        "{:?}",
        fixture.store.ranged_gets.lock().unwrap()
    );
}

/// Gives the file at `path` other content of the same size and sets its
/// mtime back to the one the sample records: what only a tool that
/// restores mtimes produces.
fn change_behind_the_mtime(path: &Path, content: &[u8]) {
    assert_eq!(fs::metadata(path).unwrap().len(), content.len() as u64);
    fs::write(path, content).unwrap();
    fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(UNIX_EPOCH + Duration::new(MTIME as u64, 250))
        .unwrap();
}

/// The sample restored with its scan time `scan_started` and no
/// fingerprint cache (like a copy baked into an image, nothing but the
/// checkpoint vouches for these files), then README.md changed behind its
/// mtime. Returns the fixture, the directory holding the root, the root.
async fn restored_then_changed_behind_the_mtime(
    scan_started: Option<SystemTime>,
) -> (Fixture, tempfile::TempDir, std::path::PathBuf) {
    let fixture = Fixture::new().await;
    sample_scanned(&fixture, scan_started);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap();
    change_behind_the_mtime(&root.join("README.md"), b"HELLO\n");
    (fixture, tmp, root)
}

#[tokio::test]
async fn an_older_copy_with_the_recorded_sizes_and_mtimes_is_kept_unread_unless_verified() {
    let (fixture, _tmp, root) =
        restored_then_changed_behind_the_mtime(Some(SystemTime::now())).await;
    let opts = fixture.options(&root);
    let report = restore(&fixture, &opts, &NoProgress).await.unwrap();
    assert_eq!(
        (report.files_reused, report.bytes_written),
        (6, 0),
        "every file matched by size and mtime"
    );
    assert_eq!(
        fs::read(root.join("README.md")).unwrap(),
        b"HELLO\n",
        "kept without being read"
    );

    let verifying = RestoreOptions {
        verify_existing: true,
        ..opts
    };
    let report = restore(&fixture, &verifying, &NoProgress).await.unwrap();
    assert_sample(&root);
    assert_eq!((report.files_reused, report.bytes_written), (5, 6));
}

#[tokio::test]
async fn existing_files_are_read_when_the_checkpoint_cannot_vouch_for_their_mtimes() {
    // Unknown: a checkpoint from a runner that did not record its scan.
    // Racy: the recorded mtimes lie within two seconds of the scan, so a
    // second write in the same timestamp tick may have followed the read.
    let racy = UNIX_EPOCH + Duration::from_secs(MTIME as u64 + 1);
    for scan_started in [None, Some(racy)] {
        let (fixture, _tmp, root) = restored_then_changed_behind_the_mtime(scan_started).await;
        let report = restore(&fixture, &fixture.options(&root), &NoProgress)
            .await
            .unwrap();
        assert_sample(&root);
        assert_eq!(
            (report.files_reused, report.bytes_written),
            (5, 6),
            "scan started {scan_started:?}"
        );
    }
}

#[tokio::test]
async fn a_corrupt_blob_fails_its_checkpoint_and_the_older_one_is_restored_exactly() {
    let fixture = Fixture::new().await;
    let older = sample(&fixture);
    let mut b = Build::new();
    let changed = b.file("README.md", b"changed in the newer checkpoint\n", 0o644);
    let added = b.file("added.txt", b"only in the newer checkpoint\n", 0o644);
    let newer_root = b.tree(vec![changed, added]);
    let newer = b.publish(&fixture, newer_root);
    fixture.corrupt_first_blob(&newer.data_packs[0]);

    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let report = restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap();
    assert_eq!(report.checkpoint_id, older.id);
    assert_eq!(report.fell_back_from.len(), 1);
    assert_eq!(report.fell_back_from[0].checkpoint_id, newer.id.as_str());
    assert!(
        report.fell_back_from[0].reason.contains("authentication"),
        "{:?}",
        report.fell_back_from
    );
    assert_sample(&root);

    let only_newer = RestoreOptions {
        checkpoint: Some(newer.id.clone()),
        ..fixture.options(&root)
    };
    let err = restore(&fixture, &only_newer, &NoProgress)
        .await
        .unwrap_err();
    assert!(
        matches!(err.cause(), RestoreError::NothingRestorable { failures, .. } if failures.len() == 1),
        "{err}"
    );
    // It wrote over the older tree before its blob failed: that tree is no
    // checkpoint now, and says so.
    assert!(
        matches!(
            &err,
            RestoreError::Incomplete {
                left: super::Left::Marked(_),
                ..
            }
        ),
        "{err}"
    );
    assert!(root.join(super::INCOMPLETE_MARKER).exists());
    // The next restore reads every file there and clears the mark.
    let report = restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap();
    assert_eq!(report.checkpoint_id, older.id);
    assert_sample(&root);
    assert!(!root.join(super::INCOMPLETE_MARKER).exists());
}

#[tokio::test]
async fn a_truncated_meta_pack_fails_its_checkpoint() {
    let fixture = Fixture::new().await;
    let older = sample(&fixture);
    let mut b = Build::new();
    let file = b.file("x", b"x", 0o644);
    let tree = b.tree(vec![file]);
    let newer = b.publish(&fixture, tree);
    fixture
        .store
        .objects
        .lock()
        .unwrap()
        .get_mut(&format!("/packs/{}", newer.packs[0]))
        .unwrap()
        .truncate(40);

    let tmp = tempfile::tempdir().unwrap();
    let report = restore(&fixture, &fixture.options(tmp.path()), &NoProgress)
        .await
        .unwrap();
    assert_eq!(report.checkpoint_id, older.id);
    assert!(
        report.fell_back_from[0].reason.contains("corrupt"),
        "{:?}",
        report.fell_back_from
    );
}

#[tokio::test]
async fn with_every_pack_gone_the_restore_fails_naming_each_checkpoint() {
    let fixture = Fixture::new().await;
    let first = sample(&fixture);
    let mut b = Build::new();
    let file = b.file("x", b"x", 0o644);
    let tree = b.tree(vec![file]);
    let second = b.publish(&fixture, tree);
    fixture.store.objects.lock().unwrap().clear();

    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let err = restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("no checkpoint of workspace my-workspace could be restored: "),
        "{message}"
    );
    assert!(
        message.contains(first.id.as_str()) && message.contains(second.id.as_str()),
        "{message}"
    );
    assert!(message.contains("missing from the store"), "{message}");
    assert!(!root.exists(), "nothing is presented as restored");
}

/// Records what a progress bar would be told.
#[derive(Default)]
struct Recorder {
    planned: Mutex<Vec<PlannedWork>>,
    written: std::sync::atomic::AtomicU64,
    files: std::sync::atomic::AtomicU64,
    downloaded: std::sync::atomic::AtomicU64,
}

impl RestoreProgress for Recorder {
    fn planned(&self, work: &PlannedWork) {
        self.planned.lock().unwrap().push(work.clone());
    }
    fn downloaded(&self, bytes: u64) {
        self.downloaded.fetch_add(bytes, Ordering::Relaxed);
    }
    fn written(&self, bytes: u64, files: u64) {
        self.written.fetch_add(bytes, Ordering::Relaxed);
        self.files.fetch_add(files, Ordering::Relaxed);
    }
}

#[tokio::test]
async fn progress_adds_up_to_the_planned_work() {
    let fixture = Fixture::new().await;
    sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let recorder = Recorder::default();
    let report = restore(&fixture, &fixture.options(tmp.path()), &recorder)
        .await
        .unwrap();
    let planned = recorder.planned.lock().unwrap().clone();
    assert_eq!(planned.len(), 1);
    let work = &planned[0];
    assert_eq!(
        (work.files, work.files_to_write, work.files_reused),
        (6, 5, 0),
        "the empty file needs no download"
    );
    assert_eq!(work.bytes_to_write, report.bytes_written);
    assert_eq!(
        recorder.written.load(Ordering::Relaxed),
        report.bytes_written
    );
    assert_eq!(recorder.files.load(Ordering::Relaxed), 5);
    assert_eq!(
        recorder.downloaded.load(Ordering::Relaxed),
        work.bytes_to_download
    );
}

#[tokio::test]
async fn a_local_failure_stops_the_restore_instead_of_falling_back() {
    let fixture = Fixture::new().await;
    sample(&fixture);
    sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("a-file");
    fs::write(&root, b"not a directory").unwrap();
    let err = restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap_err();
    assert!(matches!(err, RestoreError::Local(_)), "{err}");
    assert!(err.to_string().contains("not a directory"), "{err}");
    assert_eq!(fs::read(&root).unwrap(), b"not a directory");
}

#[tokio::test]
async fn a_workspace_without_checkpoints_is_an_error_and_creates_nothing() {
    let fixture = Fixture::new().await;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let err = restore(&fixture, &fixture.options(&root), &NoProgress)
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "workspace my-workspace has no checkpoints");
    assert!(!root.exists());
}

#[tokio::test]
async fn an_expired_url_is_replaced_by_asking_for_the_manifest_again() {
    let fixture = Fixture::new().await;
    sample(&fixture);
    *fixture.signatures.lock().unwrap() = vec!["sig=expired", "sig=ok"];
    let tmp = tempfile::tempdir().unwrap();
    let report = restore(&fixture, &fixture.options(tmp.path()), &NoProgress)
        .await
        .unwrap();
    assert!(report.fell_back_from.is_empty());
    assert_sample(tmp.path());
    assert_eq!(
        fixture.calls.load(Ordering::SeqCst),
        2,
        "one manifest, then one refresh"
    );

    let refused = Fixture::new().await;
    sample(&refused);
    *refused.signatures.lock().unwrap() = vec!["sig=expired"];
    let tmp = tempfile::tempdir().unwrap();
    let err = restore(&refused, &refused.options(tmp.path()), &NoProgress)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("403"), "{err}");
    assert!(refused.calls.load(Ordering::SeqCst) <= 1 + fetch::MAX_URL_REFRESHES as usize);
}

#[test]
fn statuses_read_as_words() {
    let status = tonic::Status::not_found("workspace \"x\" not found");
    assert_eq!(describe_status(&status), "workspace \"x\" not found");
    let status = tonic::Status::permission_denied("unknown token");
    assert_eq!(describe_status(&status), "permission denied: unknown token");
}

// ---------------------------------------------------------------------------
// The host's pack cache

fn with_pack_cache(opts: RestoreOptions, dir: &Path, max_bytes: u64) -> RestoreOptions {
    RestoreOptions {
        pack_cache: Some(PackCacheConfig {
            dir: dir.to_owned(),
            max_bytes,
        }),
        ..opts
    }
}

/// Piece files of a pack cache directory.
fn pieces(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("p1-"))
        .collect();
    found.sort();
    found
}

#[tokio::test]
async fn a_second_restore_with_a_warm_pack_cache_asks_the_store_for_nothing() {
    let fixture = Fixture::new().await;
    sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let packs = tmp.path().join("pack-cache");

    let first = restore(
        &fixture,
        &with_pack_cache(fixture.options(&tmp.path().join("one")), &packs, 1 << 30),
        &NoProgress,
    )
    .await
    .unwrap();
    assert_eq!(first.bytes_from_cache, 0);
    assert!(first.bytes_downloaded > 0);
    assert!(
        !pieces(&packs).is_empty(),
        "the first restore filled the cache"
    );

    let requests = fixture.store.requests.load(Ordering::SeqCst);
    let root = tmp.path().join("two");
    let second = restore(
        &fixture,
        &with_pack_cache(fixture.options(&root), &packs, 1 << 30),
        &NoProgress,
    )
    .await
    .unwrap();
    assert_sample(&root);
    assert_eq!(
        fixture.store.requests.load(Ordering::SeqCst),
        requests,
        "the store was not asked for anything"
    );
    assert_eq!(second.bytes_downloaded, 0);
    assert!(
        second.bytes_from_cache >= first.bytes_downloaded - 16 * 3,
        "all but the headers came from the cache: {} of {}",
        second.bytes_from_cache,
        first.bytes_downloaded
    );
    let json = second.to_json();
    assert_eq!(json["bytes_downloaded"], 0);
    assert_eq!(json["bytes_from_cache"], second.bytes_from_cache);
}

#[tokio::test]
async fn tampered_pieces_are_dropped_and_fetched_from_the_store() {
    let fixture = Fixture::new().await;
    sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let packs = tmp.path().join("pack-cache");
    let opts =
        |name: &str| with_pack_cache(fixture.options(&tmp.path().join(name)), &packs, 1 << 30);
    restore(&fixture, &opts("one"), &NoProgress).await.unwrap();

    // A hostile neighbour flips a byte in the middle of every piece: META
    // packs, indexes and blob ranges alike.
    let tampered = pieces(&packs);
    assert!(tampered.len() >= 5, "{tampered:?}");
    for path in &tampered {
        let mut bytes = fs::read(path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x55;
        fs::write(path, bytes).unwrap();
    }
    let requests = fixture.store.requests.load(Ordering::SeqCst);
    let report = restore(&fixture, &opts("two"), &NoProgress).await.unwrap();
    assert_sample(&tmp.path().join("two"));
    assert!(
        report.fell_back_from.is_empty(),
        "{:?}",
        report.fell_back_from
    );
    assert!(report.bytes_downloaded > 0);
    assert!(fixture.store.requests.load(Ordering::SeqCst) > requests);

    // The damaged pieces were replaced by the store's bytes: a third restore
    // needs the store no more.
    let requests = fixture.store.requests.load(Ordering::SeqCst);
    let report = restore(&fixture, &opts("three"), &NoProgress)
        .await
        .unwrap();
    assert_sample(&tmp.path().join("three"));
    assert_eq!(report.bytes_downloaded, 0);
    assert_eq!(fixture.store.requests.load(Ordering::SeqCst), requests);
}

#[tokio::test]
async fn a_piece_that_vanished_is_a_miss_not_a_failure() {
    let fixture = Fixture::new().await;
    let published = sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let packs = tmp.path().join("pack-cache");
    let opts =
        |name: &str| with_pack_cache(fixture.options(&tmp.path().join(name)), &packs, 1 << 30);
    restore(&fixture, &opts("one"), &NoProgress).await.unwrap();
    // Everything of the first DATA pack is evicted by someone else.
    let gone = published.data_packs[0].to_string();
    for path in pieces(&packs) {
        if path.to_string_lossy().contains(&gone) {
            fs::remove_file(path).unwrap();
        }
    }
    let report = restore(&fixture, &opts("two"), &NoProgress).await.unwrap();
    assert_sample(&tmp.path().join("two"));
    assert!(report.bytes_downloaded > 0 && report.bytes_from_cache > 0);
}

#[tokio::test]
async fn two_restores_at_once_share_one_pack_cache() {
    let fixture = Fixture::new().await;
    sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let packs = tmp.path().join("pack-cache");
    let opts =
        |name: &str| with_pack_cache(fixture.options(&tmp.path().join(name)), &packs, 1 << 30);
    let (opts_a, opts_b) = (opts("a"), opts("b"));
    let (a, b) = tokio::join!(
        restore(&fixture, &opts_a, &NoProgress),
        restore(&fixture, &opts_b, &NoProgress)
    );
    a.unwrap();
    b.unwrap();
    assert_sample(&tmp.path().join("a"));
    assert_sample(&tmp.path().join("b"));
    let leftovers: Vec<_> = fs::read_dir(&packs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // Whatever they left is whole: a third restore takes it all from there.
    let requests = fixture.store.requests.load(Ordering::SeqCst);
    let report = restore(&fixture, &opts("c"), &NoProgress).await.unwrap();
    assert_sample(&tmp.path().join("c"));
    assert_eq!(report.bytes_downloaded, 0);
    assert_eq!(fixture.store.requests.load(Ordering::SeqCst), requests);
}

#[tokio::test]
async fn a_small_pack_cache_stays_within_its_bound() {
    let fixture = Fixture::new().await;
    sample(&fixture);
    let tmp = tempfile::tempdir().unwrap();
    let roomy = tmp.path().join("roomy");
    restore(
        &fixture,
        &with_pack_cache(fixture.options(&tmp.path().join("zero")), &roomy, 1 << 30),
        &NoProgress,
    )
    .await
    .unwrap();
    let everything: u64 = pieces(&roomy)
        .iter()
        .map(|p| fs::metadata(p).unwrap().len())
        .sum();
    let packs = tmp.path().join("pack-cache");
    let bound = everything * 2 / 3;
    for name in ["one", "two"] {
        let root = tmp.path().join(name);
        restore(
            &fixture,
            &with_pack_cache(fixture.options(&root), &packs, bound),
            &NoProgress,
        )
        .await
        .unwrap();
        assert_sample(&root);
        let held: u64 = pieces(&packs)
            .iter()
            .map(|p| fs::metadata(p).unwrap().len())
            .sum();
        assert!(held <= bound, "{held} bytes held, bound {bound}");
    }
}
