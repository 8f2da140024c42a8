//! What every remote store's tests share: plain PUT and GET on signed
//! URLs, and one scenario, a coordinator on the store committing, serving
//! restores and collecting garbage through the provider's own URLs, with
//! the store's real server behind them.

use std::time::{Duration, SystemTime};

use cairn_coordinator::clock::Clock;
use cairn_coordinator::store::{ObjectKey, ObjectStore, RemoteStore};
use cairn_engine::client::CoordinatorClient;
use cairn_engine::format::FinishedPack;
use cairn_proto::domain::PackKind;
use cairn_proto::pb;
use cairn_proto::pb::admin_service_client::AdminServiceClient;
use sha2::{Digest, Sha256};

use super::harness::*;

async fn collect(client: &CoordinatorClient) -> pb::GcReport {
    AdminServiceClient::new(client.auth_channel())
        .collect_garbage(pb::CollectGarbageRequest { dry_run: false })
        .await
        .unwrap()
        .into_inner()
}

/// PUTs `body` to a signed URL with `headers`; the status.
pub async fn put(url: &str, headers: &[(String, String)], body: Vec<u8>) -> u16 {
    let mut request = reqwest::Client::new().put(url).body(body);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    request.send().await.unwrap().status().as_u16()
}

/// GETs a signed URL; the status and the body.
pub async fn get(url: &str) -> (u16, Vec<u8>) {
    let response = reqwest::get(url).await.unwrap();
    let status = response.status().as_u16();
    (status, response.bytes().await.unwrap().to_vec())
}

fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// `store` (a remote store whose listing pages every two objects) lists
/// every object under its prefix, and only those, with sizes and times,
/// and deletes idempotently; `root` is the same store without a prefix.
fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

pub async fn pages_through_everything_under_the_prefix_and_deletes(
    store: &dyn ObjectStore,
    root: &dyn ObjectStore,
) {
    let keys = [
        "packs/default/aa/aa1",
        "packs/default/bb/bb2",
        "packs/default/cc/cc3",
        "packs/other/dd/dd4",
        "keys/default/k1",
    ];
    let before = SystemTime::now() - Duration::from_secs(5);
    for (i, key) in keys.iter().enumerate() {
        let key = ObjectKey::new(*key).unwrap();
        let bytes = vec![b'x'; i + 1];
        let url = store
            .presign_put(
                &key,
                bytes.len() as u64,
                sha256(&bytes),
                Duration::from_secs(60),
                None,
            )
            .await
            .unwrap();
        assert!(is_success(put(&url.url, &url.headers, bytes).await));
    }
    // Outside the prefix: not this store's.
    let outside = ObjectKey::new("packs/default/ee/ee5").unwrap();
    let url = root
        .presign_put(&outside, 1, sha256(b"y"), Duration::from_secs(60), None)
        .await
        .unwrap();
    assert!(is_success(put(&url.url, &url.headers, b"y".to_vec()).await));

    let all = store.list("").await.unwrap();
    let listed: Vec<_> = all.iter().map(|o| o.key.as_str()).collect();
    let mut expected = keys.to_vec();
    expected.sort();
    assert_eq!(listed, expected);
    assert!(
        all.iter().all(
            |o| o.modified > before && o.modified <= SystemTime::now() + Duration::from_secs(1)
        )
    );
    let packs = store.list("packs/default/").await.unwrap();
    assert_eq!(
        packs
            .iter()
            .map(|o| (o.key.as_str(), o.size))
            .collect::<Vec<_>>(),
        [
            ("packs/default/aa/aa1", 1),
            ("packs/default/bb/bb2", 2),
            ("packs/default/cc/cc3", 3)
        ]
    );
    assert!(store.list("packs/none/").await.unwrap().is_empty());
    // Everything the root holds, the prefixed objects among them.
    assert_eq!(root.list("").await.unwrap().len(), keys.len() + 1);

    let gone = ObjectKey::new("packs/default/bb/bb2").unwrap();
    store.delete(&gone).await.unwrap();
    store.delete(&gone).await.unwrap();
    assert_eq!(store.stat(&gone).await.unwrap(), None);
    assert_eq!(store.list("packs/default/").await.unwrap().len(), 2);
}

/// A coordinator on `remote`: a checkpoint's packs go to the store through
/// the URLs handed out, with the headers `header` says each upload URL of
/// a pack names among its own; its commit finds them; the restore
/// manifest's URLs read them back byte for byte; a commit naming a pack
/// never uploaded is refused; collection deletes retired packs and orphan
/// uploads after the grace. Returns the key of a pack that stays.
pub async fn on_a_remote_store(
    remote: RemoteStore,
    header: impl Fn(&FinishedPack<Vec<u8>>) -> (String, String),
) -> ObjectKey {
    let store = remote.open().unwrap();
    let clock = Clock::system();
    let dir = data_dir();
    let moved = clock.clone();
    let mut server = TestServer::start_with(dir.path(), move |config| {
        config.store = Some(remote);
        config.clock = moved;
        config.gc.interval = None;
    })
    .await;
    server.own_dir(dir);
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "remote").await.id;
    client
        .workspaces
        .set_retention(pb::SetRetentionRequest {
            workspace: ws.clone(),
            keep_last: Some(1),
            finished_expiry: None,
        })
        .await
        .unwrap();
    let key = |pack: &FinishedPack<Vec<u8>>| {
        ObjectKey::new(format!(
            "packs/default/{}/{}",
            &pack.id.as_str()[..2],
            pack.id
        ))
        .unwrap()
    };
    let size_in_store = async |pack: &FinishedPack<Vec<u8>>| store.stat(&key(pack)).await.unwrap();

    // A checkpoint whose packs go to the store through the URLs handed out
    // (with the headers they name), and whose commit finds them there.
    let begun = begin(&mut client, &ws).await;
    let keys = keys_of(&begun);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree of the first state"]);
    let data = build_pack(&keys, PackKind::Data, &[b"the first state"]);
    let urls = prepare(&mut client, &ws, &[&meta, &data]).await;
    for (url, pack) in urls.iter().zip([&meta, &data]) {
        let (name, value) = header(pack);
        assert_eq!(url.headers.get(&name), Some(&value), "{}", url.pack_id);
    }
    upload(&mut client, &ws, &[&meta, &data]).await;
    assert_eq!(size_in_store(&data).await, Some(data.size));
    let both = [&meta, &data];
    let first = commit(&mut client, commit_request(&begun, &meta, &both, &both)).await;

    // The restore manifest's URLs read the packs back byte for byte.
    let restore = manifest(&mut client, &ws, &first.id).await;
    assert_eq!(restore.packs.len(), 2);
    for location in &restore.packs {
        let pack = if location.pack_id == meta.id.as_str() {
            &meta
        } else {
            &data
        };
        assert_eq!(get(&location.url).await, (200, pack.sink.clone()));
    }

    // A commit naming a pack that never reached the store is refused.
    let begun = begin(&mut client, &ws).await;
    let missing = build_pack(&keys_of(&begun), PackKind::Meta, &[b"never uploaded"]);
    let status = commit_err(
        &mut client,
        commit_request(&begun, &missing, &[&missing], &[&missing]),
    )
    .await;
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");

    // A second checkpoint retires the first; an upload nobody commits is an
    // orphan. Past the grace both go from the store.
    let second = checkpoint(&mut client, &ws, b"the second state").await;
    let begun = begin(&mut client, &ws).await;
    let abandoned = build_pack(&keys_of(&begun), PackKind::Data, &[b"never committed"]);
    upload(&mut client, &ws, &[&abandoned]).await;
    let report = collect(&client).await;
    assert_eq!(report.packs_condemned, 2, "{report:?}");
    assert_eq!(report.orphans_swept, 0, "young uploads may still commit");
    assert!(size_in_store(&data).await.is_some() && size_in_store(&abandoned).await.is_some());
    clock.advance(Duration::from_secs(3 * 3600));
    let report = collect(&client).await;
    assert_eq!(report.packs_swept, 2, "{report:?}");
    assert_eq!(report.orphans_swept, 1, "{report:?}");
    for gone in [&meta, &data, &abandoned] {
        assert_eq!(
            size_in_store(gone).await,
            None,
            "{} is still in the store",
            gone.id
        );
    }
    // What the second checkpoint holds stays.
    let kept = manifest(&mut client, &ws, &second.id).await;
    let kept = kept.packs.first().expect("the second checkpoint has packs");
    let kept = ObjectKey::new(format!(
        "packs/default/{}/{}",
        &kept.pack_id[..2],
        kept.pack_id
    ))
    .unwrap();
    assert!(store.stat(&kept).await.unwrap().is_some());
    server.stop().await;
    kept
}
