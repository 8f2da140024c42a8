//! Hostile input: checkpoints crafted by hand with the runner's own format
//! library, uploaded and committed through the real protocol, each trying to
//! make restore write outside its root. Every one is refused with an error
//! naming the problem, and a sentinel directory around the root stays empty.

use std::fs;
use std::path::Path;

use bytes::Bytes;
use cairn_e2e::{
    Coordinator, TreeSnapshot, block_on, dir_names, json_str, symlink, tempdir, write,
};
use cairn_engine::client::CoordinatorClient as Api;
use cairn_engine::format::{
    ChunkRef, Entry, EntryKind, FORMAT_VERSION, FinishedPack, MAX_CHUNK_LEN, PackBuilder,
    TenantKeys, Tree, seal,
};
use cairn_engine::transfer::BlobTransfer;
use cairn_proto::domain::PackKind;
use cairn_proto::ids::BlobId;
use cairn_proto::pb;

/// A checkpoint being made by hand: its blobs, sealed into packs at commit.
struct Craft {
    begin: pb::BeginCheckpointResponse,
    keys: TenantKeys,
    meta: Vec<(BlobId, Vec<u8>)>,
    data: Vec<(BlobId, Vec<u8>)>,
}

impl Craft {
    async fn begin(api: &mut Api, workspace: &str) -> Self {
        let begin = api
            .checkpoints
            .begin_checkpoint(pb::BeginCheckpointRequest {
                workspace: workspace.to_owned(),
                generation: 0,
            })
            .await
            .expect("BeginCheckpoint")
            .into_inner();
        let key = begin
            .key
            .clone()
            .expect("BeginCheckpoint returns the tenant key");
        let keys = TenantKeys::derive(key.key_id, &key.secret).expect("a 32-byte tenant secret");
        Self {
            begin,
            keys,
            meta: Vec::new(),
            data: Vec::new(),
        }
    }

    fn file(&mut self, name: &[u8], content: &[u8]) -> Entry {
        let chunks = if content.is_empty() {
            Vec::new()
        } else {
            let id = self.keys.blob_id(content);
            if !self.data.iter().any(|(known, _)| *known == id) {
                self.data.push((id, content.to_vec()));
            }
            vec![ChunkRef {
                id,
                len: content.len() as u32,
            }]
        };
        entry(
            name,
            EntryKind::File {
                size: content.len() as u64,
                chunks,
            },
            0o644,
        )
    }

    /// Encodes `entries` as given (unsorted, duplicated, hostile) into a tree blob.
    fn tree(&mut self, entries: Vec<Entry>) -> BlobId {
        let bytes = Tree { entries }.encode();
        let id = self.keys.blob_id(&bytes);
        self.meta.push((id, bytes));
        id
    }

    fn pack(&self, kind: PackKind, blobs: &[(BlobId, Vec<u8>)]) -> FinishedPack<Vec<u8>> {
        let mut builder = PackBuilder::new(kind, Vec::new()).unwrap();
        for (id, plaintext) in blobs {
            let mut sealed = Vec::new();
            seal(&self.keys, id, plaintext, &mut sealed);
            builder.add(*id, &sealed, plaintext.len() as u32).unwrap();
        }
        builder.finish(&self.keys).unwrap()
    }

    /// Uploads the packs through signed URLs and commits; returns the checkpoint id.
    async fn commit(self, api: &mut Api, workspace: &str, root: BlobId) -> String {
        let mut packs = vec![self.pack(PackKind::Meta, &self.meta)];
        if !self.data.is_empty() {
            packs.push(self.pack(PackKind::Data, &self.data));
        }
        let urls = api
            .checkpoints
            .prepare_uploads(pb::PrepareUploadsRequest {
                workspace: workspace.to_owned(),
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
            .expect("PrepareUploads")
            .into_inner()
            .urls;
        let transfer = BlobTransfer::default();
        for pack in &packs {
            let signed = urls
                .iter()
                .find(|u| u.pack_id == pack.id.as_str())
                .unwrap_or_else(|| panic!("no upload URL for pack {}", pack.id));
            transfer
                .put(&signed.url, &signed.headers, Bytes::from(pack.sink.clone()))
                .await
                .expect("pack upload");
        }
        let key_id = self.begin.key.as_ref().expect("key").key_id.clone();
        let request = pb::CommitCheckpointRequest {
            workspace: workspace.to_owned(),
            generation: self.begin.generation,
            parent_checkpoint_id: self.begin.parent_checkpoint_id.clone(),
            reason: pb::CheckpointReason::Manual as i32,
            format_version: FORMAT_VERSION,
            root_tree: root.as_bytes().to_vec(),
            new_packs: packs
                .iter()
                .map(|p| pb::NewPack {
                    pack_id: p.id.to_string(),
                    kind: pb::PackKind::from(p.kind) as i32,
                    size: p.size,
                    index_offset: p.index_offset,
                    index_length: p.index_length,
                    blob_ids: p.blob_ids.iter().map(|b| b.as_bytes().to_vec()).collect(),
                })
                .collect(),
            referenced_packs: packs.iter().map(|p| p.id.to_string()).collect(),
            stats: Some(pb::CheckpointStats::default()),
            repos: Vec::new(),
            warnings: Vec::new(),
            harness: None,
            key_id,
            request_id: String::new(),
        };
        api.checkpoints
            .commit_checkpoint(request)
            .await
            .expect("CommitCheckpoint")
            .into_inner()
            .id
    }
}

fn entry(name: &[u8], kind: EntryKind, mode: u32) -> Entry {
    Entry {
        name: name.to_vec(),
        kind,
        mode,
        mtime_sec: 1_700_000_000,
        mtime_nsec: 0,
        uid: 0,
        gid: 0,
    }
}

/// One hostile checkpoint and what its refusal must name: from every group
/// of words, at least one.
struct Case {
    label: &'static str,
    checkpoint: String,
    named_by: Vec<Vec<String>>,
}

fn words(groups: &[&[&str]]) -> Vec<Vec<String>> {
    groups
        .iter()
        .map(|g| g.iter().map(|w| w.to_string()).collect())
        .collect()
}

async fn craft_cases(api: &mut Api, workspace: &str, sentinel: &Path) -> Vec<Case> {
    let mut cases = Vec::new();
    let sentinel = sentinel.to_str().unwrap();

    let mut craft = Craft::begin(api, workspace).await;
    let escape = craft.file(b"../x", b"escaped through a name\n");
    let ok = craft.file(b"ok.txt", b"fine\n");
    let root = craft.tree(vec![escape, ok]);
    cases.push(Case {
        label: "a file named ../x",
        checkpoint: craft.commit(api, workspace, root).await,
        named_by: words(&[&["../x"]]),
    });

    let mut craft = Craft::begin(api, workspace).await;
    let x = craft.file(b"x", b"escaped through a parent directory\n");
    let parent = craft.tree(vec![x]);
    let ok = craft.file(b"ok.txt", b"fine\n");
    let root = craft.tree(vec![
        entry(b"..", EntryKind::Dir { tree: parent }, 0o755),
        ok,
    ]);
    cases.push(Case {
        label: "a directory named ..",
        checkpoint: craft.commit(api, workspace, root).await,
        named_by: words(&[&[".."]]),
    });

    let absolute = format!("{sentinel}/absolute");
    let mut craft = Craft::begin(api, workspace).await;
    let file = craft.file(absolute.as_bytes(), b"escaped through an absolute name\n");
    let root = craft.tree(vec![file]);
    cases.push(Case {
        label: "an absolute path as a name",
        checkpoint: craft.commit(api, workspace, root).await,
        named_by: vec![vec![absolute.clone()]],
    });

    let mut craft = Craft::begin(api, workspace).await;
    let inner = craft.file(b"f", b"written through a symlink\n");
    let dir = craft.tree(vec![inner]);
    let root = craft.tree(vec![
        entry(
            b"a",
            EntryKind::Symlink {
                target: sentinel.as_bytes().to_vec(),
            },
            0o777,
        ),
        entry(b"a", EntryKind::Dir { tree: dir }, 0o755),
    ]);
    cases.push(Case {
        label: "a symlink a to outside and a directory a with a file",
        checkpoint: craft.commit(api, workspace, root).await,
        named_by: words(&[&["twice", "duplicate", "symlink"]]),
    });

    let mut craft = Craft::begin(api, workspace).await;
    let ok = craft.file(b"ok.txt", b"fine\n");
    let root = craft.tree(vec![ok, entry(b"pipe", EntryKind::Fifo, 0o644)]);
    cases.push(Case {
        label: "a fifo",
        checkpoint: craft.commit(api, workspace, root).await,
        named_by: words(&[&["fifo"]]),
    });

    // 2 TiB declared, consistently: the same (absent) 8 MiB chunk over and
    // over. Refusing it must not depend on downloading anything.
    let mut craft = Craft::begin(api, workspace).await;
    let chunk = ChunkRef {
        id: BlobId([0x42; 32]),
        len: MAX_CHUNK_LEN,
    };
    let count = (2u64 << 40) / u64::from(MAX_CHUNK_LEN);
    let huge = entry(
        b"huge.bin",
        EntryKind::File {
            size: count * u64::from(MAX_CHUNK_LEN),
            chunks: vec![chunk; count as usize],
        },
        0o644,
    );
    let ok = craft.file(b"ok.txt", b"fine\n");
    let root = craft.tree(vec![huge, ok]);
    cases.push(Case {
        label: "a file declaring 2 TiB",
        checkpoint: craft.commit(api, workspace, root).await,
        // Refused as too large, not for its missing chunk.
        named_by: words(&[&["huge.bin"], &["size", "large", "limit", "tib"]]),
    });

    cases
}

#[test]
fn hand_made_hostile_trees_are_refused_and_nothing_lands_outside_the_root() {
    let tmp = tempdir("hostile");
    let sentinel = tmp.path().join("sentinel");
    let root = sentinel.join("root");
    fs::create_dir_all(&root).unwrap();

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("hostile");
    let cases = block_on(async {
        let mut api = coordinator.admin().await;
        craft_cases(&mut api, &workspace, &sentinel).await
    });

    let client = coordinator.client();
    for case in &cases {
        let outcome = client.try_restore(&root, &workspace, &["--checkpoint", &case.checkpoint]);
        assert_eq!(
            outcome.status.code(),
            Some(1),
            "{}: restore must refuse it: {outcome}",
            case.label
        );
        assert!(
            outcome.stderr.contains("error:"),
            "{}: {outcome}",
            case.label
        );
        let stderr = outcome.stderr.to_lowercase();
        for group in &case.named_by {
            assert!(
                group.iter().any(|w| stderr.contains(&w.to_lowercase())),
                "{}: the error does not name the problem (expected one of {group:?}): {outcome}",
                case.label,
            );
        }
        assert_eq!(
            dir_names(&sentinel),
            vec!["root".to_owned()],
            "{}: restore wrote outside its root",
            case.label
        );
    }
}

#[test]
fn restoring_over_a_symlink_where_a_directory_belongs_writes_nothing_through_it() {
    let tmp = tempdir("hostile-over-symlink");
    let source = tmp.path().join("source");
    write(&source.join("a/f.txt"), "inside a\n");
    write(&source.join("a/sub/g.txt"), "deeper inside a\n");
    write(
        &source.join("b.txt"),
        "a file that is a symlink on the target\n",
    );

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("over-symlink");
    let checkpoint = coordinator.client().checkpoint(&source, &workspace);
    let checkpoint_id = json_str(&checkpoint, "checkpoint_id");

    // The target already has symlinks where the checkpoint has a directory
    // and a file, both pointing outside the root.
    let sentinel = tmp.path().join("sentinel");
    let outside_dir = sentinel.join("outside");
    let outside_file = sentinel.join("outside.txt");
    let root = sentinel.join("root");
    fs::create_dir_all(&outside_dir).unwrap();
    fs::create_dir_all(&root).unwrap();
    write(&outside_file, "untouched\n");
    symlink(&outside_dir, &root.join("a"));
    symlink(&outside_file, &root.join("b.txt"));

    coordinator
        .client()
        .try_restore(&root, &workspace, &["--checkpoint", checkpoint_id])
        .assert_success();
    assert!(
        dir_names(&outside_dir).is_empty(),
        "restore wrote through the symlink a: {:?}",
        dir_names(&outside_dir)
    );
    assert_eq!(
        fs::read_to_string(&outside_file).unwrap(),
        "untouched\n",
        "restore wrote through the symlink b.txt"
    );
    assert_eq!(dir_names(&sentinel), vec!["outside", "outside.txt", "root"]);
    TreeSnapshot::take(&source).assert_matches(&root, false);
}
