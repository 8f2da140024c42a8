//! The Azure store against Azure's storage emulator (Azurite), which checks
//! SAS signatures: what an upload URL binds is refused when changed, what
//! it cannot bind (the size) is caught by the commit, and a coordinator on
//! Azure commits, serves restores and collects garbage through it. These
//! tests fail, never skip, when Azurite is not installed.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use cairn_coordinator::store::azure::{AzureConfig, SAS_VERSION};
use cairn_coordinator::store::{AzureStore, ObjectKey, ObjectStore, RemoteStore, StoreLocation};
use cairn_utils::testing::Azurite;

use super::remote_stores::{
    get, on_a_remote_store, pages_through_everything_under_the_prefix_and_deletes, put,
};

const CONTAINER: &str = "cairn-test";
const PREFIX: &str = "team/one";

/// Creates `container` with an account SAS (a service SAS cannot create
/// containers); the coordinator expects its container to exist.
async fn create_container(azurite: &Azurite, container: &str) {
    let key = base64::engine::general_purpose::STANDARD
        .decode(Azurite::KEY)
        .unwrap();
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key);
    let expiry = "2099-01-01T00:00:00Z";
    // "Create an account SAS", version 2020-12-06 and later.
    let to_sign = format!(
        "{}\ncw\nb\nc\n\n{expiry}\n\n\n{SAS_VERSION}\n\n",
        Azurite::ACCOUNT
    );
    let sig = base64::engine::general_purpose::STANDARD
        .encode(ring::hmac::sign(&key, to_sign.as_bytes()).as_ref());
    let mut url = url::Url::parse(&format!("{}/{container}", azurite.endpoint())).unwrap();
    url.query_pairs_mut()
        .append_pair("restype", "container")
        .append_pair("sv", SAS_VERSION)
        .append_pair("ss", "b")
        .append_pair("srt", "c")
        .append_pair("sp", "cw")
        .append_pair("se", expiry)
        .append_pair("sig", &sig);
    let response = reqwest::Client::new()
        .put(url)
        .header("content-length", "0")
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    assert_eq!(status, 201, "{}", response.text().await.unwrap());
}

/// A fresh Azurite with the test container; the directory goes with it.
async fn azurite() -> (tempfile::TempDir, Azurite) {
    // The tests' own HTTP clients need rustls' provider too.
    cairn_engine::transfer::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let azurite = Azurite::start(dir.path());
    create_container(&azurite, CONTAINER).await;
    (dir, azurite)
}

fn config(azurite: &Azurite, prefix: &str) -> AzureConfig {
    let env = azurite.env();
    let location: StoreLocation = format!("azure://{CONTAINER}/{prefix}").parse().unwrap();
    let remote = RemoteStore::from_vars(&location, |name| {
        env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
    })
    .unwrap();
    match remote {
        RemoteStore::Azure(config) => config,
        other => panic!("an azure:// location gave {other:?}"),
    }
}

/// `url` with one character of its `sig` changed.
fn tampered_signature(url: &str) -> String {
    let at = url.find("sig=").unwrap() + "sig=".len();
    let mut bytes = url.as_bytes().to_vec();
    bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
    String::from_utf8(bytes).unwrap()
}

#[tokio::test]
async fn sas_urls_bind_blob_permission_and_expiry_and_azurite_refuses_changed_ones() {
    let (_dir, azurite) = azurite().await;
    let store = AzureStore::new(config(&azurite, PREFIX)).unwrap();
    let key = ObjectKey::new("packs/default/ab/ab01").unwrap();
    let bytes = b"pack bytes, sealed elsewhere".repeat(100);
    let ttl = Duration::from_secs(60);
    let signed = store
        .presign_put(&key, bytes.len() as u64, [0; 32], ttl, None)
        .await
        .unwrap();
    assert_eq!(signed.method, "PUT");
    assert_eq!(
        signed.headers,
        [("x-ms-blob-type".to_owned(), "BlockBlob".to_owned())]
    );
    // A changed signature, or a key the account does not have, is refused.
    assert_eq!(
        put(
            &tampered_signature(&signed.url),
            &signed.headers,
            bytes.clone()
        )
        .await,
        403
    );
    let mut forged = config(&azurite, PREFIX);
    forged.key =
        cairn_coordinator::store::azure::AccountKey::from_base64("bm90LXRoZS1rZXk=").unwrap();
    let forged = AzureStore::new(forged)
        .unwrap()
        .presign_put(&key, bytes.len() as u64, [0; 32], ttl, None)
        .await
        .unwrap();
    assert_eq!(put(&forged.url, &forged.headers, bytes.clone()).await, 403);
    // A download URL does not upload.
    let read = store.presign_get(&key, ttl, None).await.unwrap();
    assert_eq!(put(&read.url, &signed.headers, bytes.clone()).await, 403);
    assert_eq!(
        store.stat(&key).await.unwrap(),
        None,
        "nothing refused was stored"
    );

    // As signed: stored under the location's prefix, read back whole and
    // by range.
    assert_eq!(put(&signed.url, &signed.headers, bytes.clone()).await, 201);
    assert_eq!(store.stat(&key).await.unwrap(), Some(bytes.len() as u64));
    assert_eq!(get(&read.url).await, (200, bytes.clone()));
    let ranged = reqwest::Client::new()
        .get(&read.url)
        .header("range", "bytes=5-9")
        .send()
        .await
        .unwrap();
    assert_eq!(ranged.status().as_u16(), 206);
    assert_eq!(ranged.bytes().await.unwrap().as_ref(), &bytes[5..10]);
    assert!(
        read.url.contains(&format!("/{CONTAINER}/{PREFIX}/{key}?")),
        "{}",
        read.url
    );
    // The signature names the blob: another one is refused.
    let elsewhere = read.url.replace("/ab01?", "/ab02?");
    assert_eq!(get(&elsewhere).await.0, 403);

    // A SAS signs no header: a body of another size is accepted by the
    // store, and it is the commit's size check that refuses the pack.
    let other = ObjectKey::new("packs/default/ab/ab02").unwrap();
    let loose = store
        .presign_put(&other, 10, [0; 32], ttl, None)
        .await
        .unwrap();
    assert_eq!(put(&loose.url, &loose.headers, vec![1; 11]).await, 201);
    assert_eq!(store.stat(&other).await.unwrap(), Some(11));

    // An expired URL is refused, upload and download alike.
    let short = Duration::from_secs(1);
    let late_put = store
        .presign_put(&key, bytes.len() as u64, [0; 32], short, None)
        .await
        .unwrap();
    let late_get = store.presign_get(&key, short, None).await.unwrap();
    assert!(late_get.expires_at <= SystemTime::now() + short);
    tokio::time::sleep(Duration::from_millis(2200)).await;
    assert_eq!(
        put(&late_put.url, &late_put.headers, bytes.clone()).await,
        403
    );
    assert_eq!(get(&late_get.url).await.0, 403);
}

#[tokio::test]
async fn listing_pages_through_everything_under_the_prefix_and_delete_removes_it() {
    let (_dir, azurite) = azurite().await;
    let mut paged = config(&azurite, PREFIX);
    paged.list_page_size = 2;
    let store = AzureStore::new(paged).unwrap();
    let root = AzureStore::new(config(&azurite, "")).unwrap();
    pages_through_everything_under_the_prefix_and_deletes(&store, &root).await;

    // A key the account does not have: refused, not retried, with the
    // store's answer.
    let mut wrong = config(&azurite, PREFIX);
    wrong.key =
        cairn_coordinator::store::azure::AccountKey::from_base64("bm90LXRoZS1rZXk=").unwrap();
    let err = AzureStore::new(wrong)
        .unwrap()
        .list("packs/")
        .await
        .unwrap_err();
    assert!(!err.is_retryable(), "{err}");
    assert!(err.to_string().contains("403"), "{err}");
}

#[tokio::test]
async fn a_coordinator_on_azure_commits_serves_restores_and_collects_through_the_container() {
    let (_dir, azurite) = azurite().await;
    let remote = RemoteStore::Azure(config(&azurite, PREFIX));
    let blob_type = |_: &cairn_engine::format::FinishedPack<Vec<u8>>| {
        ("x-ms-blob-type".to_owned(), "BlockBlob".to_owned())
    };
    on_a_remote_store(remote, blob_type).await;
}
