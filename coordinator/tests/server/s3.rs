//! The S3 store against a real S3-compatible server that checks SigV4
//! presigned URLs (`s3s-fs`, see `cairn_utils::testing::S3sFs`): what an
//! upload URL binds is refused by that server when changed, and a
//! coordinator on S3 commits, serves restores and collects garbage through
//! it. These tests fail, never skip, when `s3s-fs` is not installed.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use cairn_coordinator::store::{
    ObjectKey, ObjectStore, RemoteStore, S3Store, StoreLocation, s3::S3Config,
};
use cairn_engine::format::FinishedPack;
use cairn_utils::testing::S3sFs;
use sha2::{Digest, Sha256};

use super::remote_stores::{
    get, on_a_remote_store, pages_through_everything_under_the_prefix_and_deletes, put,
};

const BUCKET: &str = "cairn-test";
const PREFIX: &str = "team/one";

/// A fresh s3s-fs with the test bucket; the directory goes with it.
fn s3s() -> (tempfile::TempDir, S3sFs) {
    // The tests' own HTTP clients need rustls' provider too.
    cairn_engine::transfer::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let server = S3sFs::start(dir.path(), &[BUCKET]);
    (dir, server)
}

/// The store's configuration for `server`, from the variables a
/// coordinator would read.
fn config(server: &S3sFs, prefix: &str) -> S3Config {
    let env = server.env();
    let location: StoreLocation = format!("s3://{BUCKET}/{prefix}").parse().unwrap();
    let remote = RemoteStore::from_vars(&location, |name| {
        env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
    })
    .unwrap();
    match remote {
        RemoteStore::S3(config) => config,
        other => panic!("an s3:// location gave {other:?}"),
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// `url` with its `X-Amz-Signature` changed in one hex digit.
fn tampered_signature(url: &str) -> String {
    let at = url.find("X-Amz-Signature=").unwrap() + "X-Amz-Signature=".len();
    let mut bytes = url.as_bytes().to_vec();
    bytes[at] = if bytes[at] == b'0' { b'1' } else { b'0' };
    String::from_utf8(bytes).unwrap()
}

#[tokio::test]
async fn upload_urls_bind_size_and_checksum_and_changed_or_expired_urls_are_refused() {
    let (_dir, s3) = s3s();
    let store = S3Store::new(config(&s3, PREFIX)).unwrap();
    let key = ObjectKey::new("packs/default/ab/ab01").unwrap();
    let bytes = b"pack bytes, sealed elsewhere".repeat(100);
    let ttl = Duration::from_secs(60);
    let signed = store
        .presign_put(&key, bytes.len() as u64, sha256(&bytes), ttl, None)
        .await
        .unwrap();
    assert_eq!(signed.method, "PUT");

    // Another size than signed: the signed content-length differs.
    let longer = [bytes.clone(), b"!".to_vec()].concat();
    assert_eq!(put(&signed.url, &signed.headers, longer).await, 403);
    // Without the checksum header the signature does not match either.
    assert_eq!(put(&signed.url, &[], bytes.clone()).await, 403);
    // A changed signature is refused.
    assert_eq!(
        put(
            &tampered_signature(&signed.url),
            &signed.headers,
            bytes.clone()
        )
        .await,
        403
    );
    // Signed by someone without the secret.
    let mut forged = config(&s3, PREFIX);
    forged.credentials = rusty_s3::Credentials::new(S3sFs::ACCESS_KEY, "not-the-secret");
    let forged = S3Store::new(forged)
        .unwrap()
        .presign_put(&key, bytes.len() as u64, sha256(&bytes), ttl, None)
        .await
        .unwrap();
    assert_eq!(put(&forged.url, &forged.headers, bytes.clone()).await, 403);
    assert_eq!(
        store.stat(&key).await.unwrap(),
        None,
        "nothing refused was stored"
    );

    // As signed: stored, under the location's prefix.
    assert_eq!(put(&signed.url, &signed.headers, bytes.clone()).await, 200);
    assert_eq!(store.stat(&key).await.unwrap(), Some(bytes.len() as u64));
    let file = s3.object_path(BUCKET, &format!("{PREFIX}/{key}"));
    assert_eq!(std::fs::read(&file).unwrap(), bytes);

    // Bytes of the signed size that do not hash to the signed checksum: the
    // header is right, the body is not, and the server says BadDigest.
    let other_key = ObjectKey::new("packs/default/ab/ab02").unwrap();
    let other = store
        .presign_put(&other_key, bytes.len() as u64, sha256(&bytes), ttl, None)
        .await
        .unwrap();
    let mut swapped = bytes.clone();
    swapped[0] ^= 1;
    assert_eq!(put(&other.url, &other.headers, swapped).await, 400);

    // Reads: whole and by range; another key with the same signature is not.
    let read = store.presign_get(&key, ttl, None).await.unwrap();
    assert_eq!(read.method, "GET");
    assert!(read.headers.is_empty(), "download URLs need no headers");
    assert_eq!(get(&read.url).await, (200, bytes.clone()));
    let ranged = reqwest::Client::new()
        .get(&read.url)
        .header("range", "bytes=5-9")
        .send()
        .await
        .unwrap();
    assert_eq!(ranged.status().as_u16(), 206);
    assert_eq!(ranged.bytes().await.unwrap().as_ref(), &bytes[5..10]);
    let elsewhere = read.url.replace("/ab01?", "/ab02?");
    assert_ne!(elsewhere, read.url);
    assert_eq!(get(&elsewhere).await.0, 403);
    assert_eq!(get(&tampered_signature(&read.url)).await.0, 403);

    // An expired URL is refused, upload and download alike.
    let short = Duration::from_secs(1);
    let late_put = store
        .presign_put(&key, bytes.len() as u64, sha256(&bytes), short, None)
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
    let (_dir, s3) = s3s();
    let mut paged = config(&s3, PREFIX);
    // Five objects in pages of two: three ListObjectsV2 calls.
    paged.list_page_size = 2;
    let store = S3Store::new(paged).unwrap();
    let root = S3Store::new(config(&s3, "")).unwrap();
    pages_through_everything_under_the_prefix_and_deletes(&store, &root).await;
}

#[tokio::test]
async fn refused_credentials_are_an_error_that_names_the_store_s_answer() {
    let (_dir, s3) = s3s();
    let mut wrong = config(&s3, PREFIX);
    wrong.credentials = rusty_s3::Credentials::new(S3sFs::ACCESS_KEY, "not-the-secret");
    let store = S3Store::new(wrong).unwrap();
    let err = store.list("packs/").await.unwrap_err();
    assert!(!err.is_retryable(), "{err}");
    assert!(err.to_string().contains("403"), "{err}");
    let err = store
        .stat(&ObjectKey::new("packs/a").unwrap())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("403"), "{err}");
}

#[tokio::test]
async fn a_coordinator_on_s3_commits_serves_restores_and_collects_through_the_bucket() {
    let (_dir, s3) = s3s();
    let remote = RemoteStore::S3(config(&s3, PREFIX));
    let checksum = |pack: &FinishedPack<Vec<u8>>| {
        let digest = base64::engine::general_purpose::STANDARD.encode(pack.id.digest());
        ("x-amz-checksum-sha256".to_owned(), digest)
    };
    let kept = on_a_remote_store(remote, checksum).await;
    // The objects are the bucket's files, under the prefix.
    let file = s3.object_path(BUCKET, &format!("{PREFIX}/{kept}"));
    assert!(file.is_file(), "{}", file.display());
}
