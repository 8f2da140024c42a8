//! Fuzzing, bounded: everything a hostile store or coordinator can feed the
//! runner — tree objects, chunk-list parts, pack headers, trailers and
//! sealed indexes, sealed blobs, restore manifests — and the restore plan
//! built from hostile trees. Each decoder must answer with a value or an
//! error, never panic, hang or allocate what the input merely claims; a plan
//! it does make keeps every path inside the restore root.
//!
//! Each property runs 2,048 cases (about a second in all), or
//! `PROPTEST_CASES` when set, for a longer run by hand.

use bytes::Bytes;
use cairn_engine::format::{
    ChunkRef, Entry, EntryKind, PackBuilder, PackIndex, TenantKeys, Tree, TreeObject, decode_part,
    open, parse_pack_header, parse_trailer, seal,
};
use cairn_engine::restore::{Manifest, MetaBlobs, TreeBounds, build_plan};
use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, PackId};
use cairn_proto::pb;
use proptest::prelude::*;
use prost::Message;

fn keys() -> TenantKeys {
    TenantKeys::derive("k1", &[7u8; 32]).unwrap()
}

fn pack_id() -> PackId {
    PackId::from_digest(&[3u8; 32])
}

fn entry(name: &[u8], kind: EntryKind) -> Entry {
    Entry {
        name: name.to_vec(),
        kind,
        mode: 0o644,
        mtime_sec: 1_700_000_000,
        mtime_nsec: 0,
        uid: 1000,
        gid: 1000,
    }
}

/// A small, valid tree of files, a symlink and a subdirectory `sub`, and
/// the subdirectory's tree, encoded.
fn valid_trees(keys: &TenantKeys) -> (Vec<u8>, Vec<u8>) {
    let sub = Tree {
        entries: vec![entry(
            b"inner.txt",
            EntryKind::File {
                size: 5,
                chunks: vec![ChunkRef {
                    id: keys.blob_id(b"inner"),
                    len: 5,
                }],
            },
        )],
    }
    .encode();
    let root = Tree {
        entries: vec![
            entry(
                b"a.txt",
                EntryKind::File {
                    size: 3,
                    chunks: vec![ChunkRef {
                        id: keys.blob_id(b"abc"),
                        len: 3,
                    }],
                },
            ),
            entry(
                b"link",
                EntryKind::Symlink {
                    target: b"a.txt".to_vec(),
                },
            ),
            entry(
                b"sub",
                EntryKind::Dir {
                    tree: keys.blob_id(&sub),
                },
            ),
        ],
    }
    .encode();
    (root, sub)
}

/// `bytes` with the bytes at `flips` (positions taken modulo its length)
/// xor-ed with their values.
fn mutate(mut bytes: Vec<u8>, flips: &[(usize, u8)]) -> Vec<u8> {
    if !bytes.is_empty() {
        for (at, with) in flips {
            let len = bytes.len();
            bytes[at % len] ^= with.max(&1);
        }
    }
    bytes
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn tree_objects_and_parts_decode_or_refuse(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(TreeObject::Entries(tree)) = TreeObject::decode(&bytes) {
            let _ = tree.validate();
        }
        let _ = decode_part(&bytes);
    }

    #[test]
    fn mutated_valid_trees_decode_or_refuse(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let (root, _) = valid_trees(&keys());
        let mutated = mutate(root.clone(), &flips);
        if let Ok(TreeObject::Entries(tree)) = TreeObject::decode(&mutated) {
            // A tree that decodes is either refused by validation or safe
            // to encode again.
            if tree.validate().is_ok() {
                let again = Tree::decode(&tree.encode()).unwrap();
                prop_assert_eq!(again, tree);
            }
        }
        let truncated = &root[..cut % (root.len() + 1)];
        let _ = TreeObject::decode(truncated);
    }

    #[test]
    fn pack_headers_trailers_and_indexes_decode_or_refuse(
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        size in any::<u64>(),
        offset in any::<u64>(),
    ) {
        let pack = pack_id();
        let _ = parse_pack_header(&pack, &bytes);
        let _ = parse_trailer(&pack, size, &bytes);
        let _ = PackIndex::open(&keys(), &pack, PackKind::Data, offset, &bytes);
        let _ = PackIndex::open(&keys(), &pack, PackKind::Meta, offset, &bytes);
    }

    #[test]
    fn sealed_blobs_open_only_when_authentic(
        plaintext in proptest::collection::vec(any::<u8>(), 0..512),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        claimed in 0usize..1 << 20,
    ) {
        let keys = keys();
        let id = keys.blob_id(&plaintext);
        let mut sealed = Vec::new();
        seal(&keys, &id, &plaintext, &mut sealed);
        prop_assert_eq!(open(&keys, &id, &sealed, plaintext.len()).unwrap(), plaintext.clone());
        let damaged = mutate(sealed.clone(), &flips);
        // Two flips of one byte with one value cancel out.
        prop_assume!(damaged != sealed);
        prop_assert!(open(&keys, &id, &damaged, plaintext.len()).is_err());
        // A hostile length claim is refused, not allocated.
        if claimed != plaintext.len() {
            prop_assert!(open(&keys, &id, &sealed, claimed).is_err());
        }
    }

    #[test]
    fn manifests_parse_or_refuse(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(message) = pb::RestoreManifest::decode(&bytes[..]) {
            let _ = Manifest::parse(message);
        }
    }

    #[test]
    fn plans_from_hostile_trees_stay_inside_the_root(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        mutate_sub in any::<bool>(),
    ) {
        let keys = keys();
        let (root, sub) = valid_trees(&keys);
        let (root, sub) = if mutate_sub {
            (root, mutate(sub, &flips))
        } else {
            (mutate(root, &flips), sub)
        };
        // The sub tree is found under the id the (possibly mutated) root
        // names only if its bytes still hash to it; a META pack holds both.
        let mut builder = PackBuilder::new(PackKind::Meta, Vec::new()).unwrap();
        for plaintext in [&root, &sub] {
            let id = keys.blob_id(plaintext);
            let mut sealed = Vec::new();
            seal(&keys, &id, plaintext, &mut sealed);
            // A mutation may make both plaintexts equal; one copy is enough.
            let _ = builder.add(id, &sealed, plaintext.len() as u32);
        }
        let pack = builder.finish(&keys).unwrap();
        let sealed_index = &pack.sink[pack.index_offset as usize..pack.index_offset as usize + pack.index_length as usize];
        let index = PackIndex::open(&keys, &pack.id, PackKind::Meta, pack.index_offset, sealed_index).unwrap();
        let mut meta = MetaBlobs::new();
        meta.add_pack(Bytes::from(pack.sink.clone()), &index);
        let root_id: BlobId = keys.blob_id(&root);
        if let Ok(plan) = build_plan(&meta, &keys, root_id, &TreeBounds::default()) {
            for planned in &plan.entries {
                let path = &planned.path[..];
                prop_assert!(!path.is_empty() && !path.starts_with(b"/"), "{:?}", path);
                for component in path.split(|b| *b == b'/') {
                    prop_assert!(!component.is_empty() && component != b"." && component != b"..",
                        "{:?}", String::from_utf8_lossy(path));
                }
            }
        }
    }
}
