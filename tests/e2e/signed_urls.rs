//! Signed URLs of the embedded blob store: each binds method, object key,
//! expiry (and for uploads size and digest); anything else is a 403. An
//! upload whose bytes do not match is refused and leaves nothing behind.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_e2e::{
    Coordinator, all_files, block_on, populate_small_workspace, put_url, sha256_hex, tempdir,
};
use cairn_proto::pb;
use reqwest::{Method, StatusCode, Url};

fn http() -> reqwest::Client {
    cairn_engine::transfer::install_crypto_provider();
    reqwest::Client::new()
}

async fn send(
    http: &reqwest::Client,
    method: Method,
    url: &str,
    body: Option<Vec<u8>>,
) -> (StatusCode, Vec<u8>) {
    let mut request = http.request(method, url);
    if let Some(body) = body {
        request = request.body(body);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("request to the blob store failed: {e}"));
    let status = response.status();
    (
        status,
        response
            .bytes()
            .await
            .map(|b| b.to_vec())
            .unwrap_or_default(),
    )
}

/// `url` with the query parameter `name` replaced by `change(old value)`.
fn with_param(url: &str, name: &str, change: impl Fn(&str) -> String) -> String {
    let mut parsed = Url::parse(url).expect("signed URLs are URLs");
    let pairs: Vec<(String, String)> = parsed
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    assert!(
        pairs.iter().any(|(k, _)| k == name),
        "{} has no {name} parameter",
        cairn_engine::transfer::redact(url)
    );
    parsed
        .query_pairs_mut()
        .clear()
        .extend_pairs(pairs.iter().map(|(k, v)| {
            if k == name {
                (k.clone(), change(v))
            } else {
                (k.clone(), v.clone())
            }
        }));
    parsed.to_string()
}

/// A signature with its first character changed (the last may only carry padding bits).
fn tamper_signature(sig: &str) -> String {
    let first = if sig.starts_with('A') { 'B' } else { 'A' };
    format!("{first}{}", &sig[1..])
}

/// `url`'s signature and expiry on `other`'s object key.
fn with_path_of(url: &str, other: &str) -> String {
    let mut parsed = Url::parse(url).unwrap();
    parsed.set_path(Url::parse(other).unwrap().path());
    parsed.to_string()
}

fn exp_of(url: &str) -> u64 {
    let parsed = Url::parse(url).unwrap();
    let exp = parsed
        .query_pairs()
        .find(|(k, _)| k == "exp")
        .expect("signed URLs carry exp")
        .1;
    exp.parse().expect("exp is Unix seconds")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn incompressible(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed)
        .collect()
}

fn object_path(coordinator: &Coordinator, tenant: &str, pack_id: &str) -> std::path::PathBuf {
    coordinator
        .blobs_dir()
        .join("packs")
        .join(tenant)
        .join(&pack_id[..2])
        .join(pack_id)
}

async fn manifest(
    api: &mut cairn_engine::client::CoordinatorClient,
    workspace: &str,
) -> pb::RestoreManifest {
    api.checkpoints
        .get_restore_manifest(pb::GetRestoreManifestRequest {
            workspace: workspace.to_owned(),
            checkpoint_id: String::new(),
            max_candidates: 0,
        })
        .await
        .expect("GetRestoreManifest")
        .into_inner()
}

fn checkpointed_workspace(coordinator: &Coordinator, dir: &Path, name: &str) -> String {
    let root = dir.join(name);
    populate_small_workspace(&root, 3);
    let workspace = coordinator.create_workspace(name);
    coordinator.client().checkpoint(&root, &workspace);
    workspace
}

#[test]
fn signed_urls_bind_method_object_and_signature_and_bad_uploads_store_nothing() {
    let tmp = tempdir("signed-urls");
    let coordinator = Coordinator::start();
    let workspace = checkpointed_workspace(&coordinator, tmp.path(), "urls");
    let http = http();

    block_on(async {
        let mut api = coordinator.admin().await;
        let manifest = manifest(&mut api, &workspace).await;
        assert!(
            manifest.packs.len() >= 2,
            "a checkpoint with files has a meta and a data pack: {manifest:?}"
        );
        let (a, b) = (&manifest.packs[0], &manifest.packs[1]);

        // The genuine article works: GET, HEAD, a range.
        let (status, body) = send(&http, Method::GET, &a.url, None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            sha256_hex(&body),
            a.pack_id,
            "the store returns the pack's bytes"
        );
        assert_eq!(
            send(&http, Method::HEAD, &a.url, None).await.0,
            StatusCode::OK
        );
        let ranged = http
            .get(&a.url)
            .header("range", "bytes=0-7")
            .send()
            .await
            .unwrap();
        assert_eq!(ranged.status(), StatusCode::PARTIAL_CONTENT);
        assert_eq!(&ranged.bytes().await.unwrap()[..], b"CAIRNPK\0");

        // Any change to what was signed: 403.
        let tampered_sig = with_param(&a.url, "sig", tamper_signature);
        assert_eq!(
            send(&http, Method::GET, &tampered_sig, None).await.0,
            StatusCode::FORBIDDEN,
            "tampered signature"
        );
        let later = with_param(&a.url, "exp", |exp| {
            (exp.parse::<u64>().unwrap() + 3600).to_string()
        });
        assert_eq!(
            send(&http, Method::GET, &later, None).await.0,
            StatusCode::FORBIDDEN,
            "extended expiry"
        );
        let other_key = with_path_of(&a.url, &b.url);
        assert_eq!(
            send(&http, Method::GET, &other_key, None).await.0,
            StatusCode::FORBIDDEN,
            "another object's key"
        );
        assert_eq!(
            send(&http, Method::PUT, &a.url, Some(body.clone())).await.0,
            StatusCode::FORBIDDEN,
            "GET URL used to PUT"
        );

        // Uploads.
        let good = incompressible(4096, 1);
        let pack_id = sha256_hex(&good);
        let signed = put_url(&mut api, &workspace, &good).await;
        assert_eq!(signed.method, "PUT");
        assert_eq!(
            send(&http, Method::GET, &signed.url, None).await.0,
            StatusCode::FORBIDDEN,
            "PUT URL used to GET"
        );
        assert_eq!(
            send(&http, Method::HEAD, &signed.url, None).await.0,
            StatusCode::FORBIDDEN,
            "PUT URL used for HEAD"
        );

        let store_before = all_files(&coordinator.blobs_dir());
        let mut wrong = good.clone();
        wrong[100] ^= 0x01;
        let (status, _) = send(&http, Method::PUT, &signed.url, Some(wrong.clone())).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "bytes that do not match the signed digest"
        );
        let (status, _) = send(&http, Method::PUT, &signed.url, Some(good[..4000].to_vec())).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "fewer bytes than the signed size"
        );
        let signed_for_wrong = with_param(&signed.url, "sha256", |_| sha256_hex(&wrong));
        let (status, _) = send(&http, Method::PUT, &signed_for_wrong, Some(wrong.clone())).await;
        assert_eq!(
            status,
            StatusCode::FORBIDDEN,
            "a digest swapped into the URL"
        );
        let resized = with_param(&signed.url, "size", |_| "4000".into());
        let (status, _) = send(&http, Method::PUT, &resized, Some(good[..4000].to_vec())).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "a size swapped into the URL");
        assert_eq!(
            all_files(&coordinator.blobs_dir()),
            store_before,
            "refused uploads left files in the store"
        );
        assert!(!object_path(&coordinator, &manifest.tenant, &pack_id).exists());

        // The coordinator agrees the pack is not there: a commit naming it is refused.
        let begin = api
            .checkpoints
            .begin_checkpoint(pb::BeginCheckpointRequest {
                workspace: workspace.clone(),
                generation: 0,
            })
            .await
            .unwrap()
            .into_inner();
        let refused = api
            .checkpoints
            .commit_checkpoint(pb::CommitCheckpointRequest {
                workspace: workspace.clone(),
                generation: begin.generation,
                parent_checkpoint_id: begin.parent_checkpoint_id.clone(),
                reason: pb::CheckpointReason::Manual as i32,
                format_version: 1,
                root_tree: vec![7; 32],
                new_packs: vec![pb::NewPack {
                    pack_id: pack_id.clone(),
                    kind: pb::PackKind::Data as i32,
                    size: good.len() as u64,
                    index_offset: 16,
                    index_length: 64,
                    // The root tree is claimed to be in it, so only its absence is wrong.
                    blob_ids: vec![vec![7; 32]],
                }],
                referenced_packs: vec![pack_id.clone()],
                stats: Some(pb::CheckpointStats::default()),
                key_id: begin.key.clone().unwrap().key_id,
                ..Default::default()
            })
            .await
            .expect_err("a commit naming a pack that was never stored");
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(
            refused.message().contains(&pack_id),
            "the refusal names the pack: {refused:?}"
        );

        // The right bytes are accepted and stored under the pack's key.
        let (status, _) = send(&http, Method::PUT, &signed.url, Some(good.clone())).await;
        assert!(
            status.is_success(),
            "a matching upload is accepted, got {status}"
        );
        assert_eq!(
            std::fs::read(object_path(&coordinator, &manifest.tenant, &pack_id)).unwrap(),
            good
        );

        // A signed URL for an object that is gone: 404.
        std::fs::remove_file(object_path(&coordinator, &manifest.tenant, &a.pack_id)).unwrap();
        assert_eq!(
            send(&http, Method::GET, &a.url, None).await.0,
            StatusCode::NOT_FOUND
        );
    });
    assert_eq!(
        coordinator.list_checkpoints(&workspace).len(),
        1,
        "the refused commit left a checkpoint"
    );
}

#[test]
fn signed_urls_stop_working_when_they_expire() {
    let tmp = tempdir("signed-urls-expiry");
    let mut coordinator = Coordinator::start();
    let workspace = checkpointed_workspace(&coordinator, tmp.path(), "expiry");
    // Same data, URLs now valid for one second.
    coordinator.restart_with(&["--url-ttl", "1s"]);
    let http = http();

    block_on(async {
        let mut api = coordinator.admin().await;
        let manifest = manifest(&mut api, &workspace).await;
        let get = &manifest.packs[0].url;
        let bytes = incompressible(2048, 2);
        let put = put_url(&mut api, &workspace, &bytes).await;

        // Wait until both URLs are past their `exp` (whole Unix seconds).
        let signed_at = unix_now();
        let expiry = [get.as_str(), put.url.as_str()]
            .iter()
            .map(|u| exp_of(u))
            .max()
            .unwrap();
        assert!(
            expiry <= signed_at + 3,
            "--url-ttl 1s signed URLs valid until {expiry}, now is {signed_at}"
        );
        while unix_now() <= expiry {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            send(&http, Method::GET, get, None).await.0,
            StatusCode::FORBIDDEN,
            "expired GET URL"
        );
        assert_eq!(
            send(&http, Method::HEAD, get, None).await.0,
            StatusCode::FORBIDDEN,
            "expired GET URL used for HEAD"
        );
        assert_eq!(
            send(&http, Method::PUT, &put.url, Some(bytes)).await.0,
            StatusCode::FORBIDDEN,
            "expired PUT URL"
        );
    });

    // With the default lifetime the same object is served again: it was the
    // expiry, not the object, that was refused.
    coordinator.restart_with(&[]);
    block_on(async {
        let mut api = coordinator.admin().await;
        let fresh = manifest(&mut api, &workspace).await;
        assert_eq!(
            send(&http, Method::GET, &fresh.packs[0].url, None).await.0,
            StatusCode::OK
        );
    });
}
