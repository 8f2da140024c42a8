//! The embedded blob server behind signed URLs.

use cairn_coordinator::signing::{Grant, UrlSigner, unix_now};
use cairn_coordinator::store::ObjectKey;
use cairn_proto::domain::PackKind;
use cairn_proto::pb;
use reqwest::StatusCode;

use crate::harness::*;

/// A workspace with one committed checkpoint, and the manifest's GET URL and
/// bytes of its data pack.
struct Stored {
    server: TestServer,
    get_url: String,
    bytes: Vec<u8>,
    object_key: String,
    _dir: tempfile::TempDir,
}

async fn stored_pack() -> Stored {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"root tree"]);
    let contents: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let data = build_pack(&keys, PackKind::Data, &[&contents]);
    upload(&mut client, &ws.id, &[&meta, &data]).await;
    commit(
        &mut client,
        commit_request(&begin, &meta, &[&meta, &data], &[&meta, &data]),
    )
    .await;
    let manifest = manifest(&mut client, &ws.id, "").await;
    let location = manifest
        .packs
        .iter()
        .find(|p| p.pack_id == data.id.to_string())
        .unwrap();
    let object_key = format!(
        "packs/{}/{}/{}",
        begin.tenant,
        &data.id.as_str()[..2],
        data.id
    );
    Stored {
        server,
        get_url: location.url.clone(),
        bytes: data.sink.clone(),
        object_key,
        _dir: dir,
    }
}

fn http() -> reqwest::Client {
    cairn_engine::transfer::install_crypto_provider();
    reqwest::Client::new()
}

#[tokio::test]
async fn get_urls_read_whole_objects_byte_ranges_and_sizes() {
    let s = stored_pack().await;
    let http = http();
    let size = s.bytes.len();
    assert!(
        s.server.object_file(&s.object_key).is_file(),
        "stored at packs/<tenant>/<xx>/<id>"
    );

    let whole = http.get(&s.get_url).send().await.unwrap();
    assert_eq!(whole.status(), StatusCode::OK);
    assert_eq!(whole.bytes().await.unwrap().as_ref(), s.bytes.as_slice());

    let first = http
        .get(&s.get_url)
        .header("range", "bytes=0-15")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(
        first.headers()["content-range"],
        format!("bytes 0-15/{size}").as_str()
    );
    assert_eq!(first.bytes().await.unwrap().as_ref(), &s.bytes[..16]);

    let tail = http
        .get(&s.get_url)
        .header("range", "bytes=-20")
        .send()
        .await
        .unwrap();
    assert_eq!(tail.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(tail.bytes().await.unwrap().as_ref(), &s.bytes[size - 20..]);

    let from = http
        .get(&s.get_url)
        .header("range", format!("bytes={}-", size - 5))
        .send()
        .await
        .unwrap();
    assert_eq!(from.bytes().await.unwrap().as_ref(), &s.bytes[size - 5..]);

    let beyond = http
        .get(&s.get_url)
        .header("range", format!("bytes={size}-"))
        .send()
        .await
        .unwrap();
    assert_eq!(beyond.status(), StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(
        beyond.headers()["content-range"],
        format!("bytes */{size}").as_str()
    );

    let head = http.head(&s.get_url).send().await.unwrap();
    assert_eq!(head.status(), StatusCode::OK);
    assert_eq!(head.headers()["content-length"], size.to_string().as_str());
    assert!(head.bytes().await.unwrap().is_empty());
}

#[tokio::test]
async fn expired_tampered_and_misused_urls_are_forbidden() {
    let s = stored_pack().await;
    let http = http();
    let key = ObjectKey::new(s.object_key.clone()).unwrap();
    let data_key: [u8; 32] = std::fs::read(s.server.data_dir.join("url-signing.key"))
        .unwrap()
        .try_into()
        .unwrap();
    let signer = UrlSigner::new(&data_key);
    let url_for = |query: String| format!("{}/o/{}?{query}", s.server.blob_url, s.object_key);

    // The real URL works, so each refusal below is about the URL alone.
    assert_eq!(
        http.get(&s.get_url).send().await.unwrap().status(),
        StatusCode::OK
    );

    let expired = url_for(signer.sign_query(&key, &Grant::Get, unix_now() - 10, None));
    let (path, query) = s.get_url.split_once('?').unwrap();
    let sig_at = query.find("sig=").unwrap() + 4;
    let mut tampered_sig = query.to_owned();
    let flipped = if &query[sig_at..sig_at + 1] == "A" {
        "B"
    } else {
        "A"
    };
    tampered_sig.replace_range(sig_at..sig_at + 1, flipped);
    let tampered_sig = format!("{path}?{tampered_sig}");
    let (stem, last) = s.object_key.split_at(s.object_key.len() - 1);
    let other_object = s.get_url.replace(
        &s.object_key,
        &format!("{stem}{}", if last == "0" { "1" } else { "0" }),
    );
    let other_key_signer =
        url_for(UrlSigner::new(&[7; 32]).sign_query(&key, &Grant::Get, unix_now() + 600, None));
    let later_expiry = {
        let exp_at = query.find("exp=").unwrap() + 4;
        let exp_end = exp_at + query[exp_at..].find('&').unwrap();
        let later: u64 = query[exp_at..exp_end].parse::<u64>().unwrap() + 3600;
        format!("{path}?{}{later}{}", &query[..exp_at], &query[exp_end..])
    };
    let unsigned = format!("{}/o/{}", s.server.blob_url, s.object_key);
    for (what, url) in [
        ("expired", &expired),
        ("tampered signature", &tampered_sig),
        ("tampered object key", &other_object),
        ("signed with another key", &other_key_signer),
        ("extended expiry", &later_expiry),
        ("no signature", &unsigned),
    ] {
        let response = http.get(url).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{what}");
        let head = http.head(url).send().await.unwrap();
        assert_eq!(head.status(), StatusCode::FORBIDDEN, "{what} (HEAD)");
    }

    // A GET URL does not allow writing, nor deleting.
    let put_with_get = http
        .put(&s.get_url)
        .body(s.bytes.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(put_with_get.status(), StatusCode::FORBIDDEN);
    let delete = http.delete(&s.get_url).send().await.unwrap();
    assert_eq!(delete.status(), StatusCode::FORBIDDEN);
    assert!(s.server.object_file(&s.object_key).is_file());

    // A PUT URL does not allow reading.
    let mut client = s.server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;
    let pack = build_pack(&keys_of(&begin), PackKind::Data, &[b"put only"]);
    let put_url = &prepare(&mut client, &ws.id, &[&pack]).await[0];
    assert_eq!(put_url.method, "PUT");
    assert_eq!(
        http.put(&put_url.url)
            .body(pack.sink.clone())
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        http.get(&put_url.url).send().await.unwrap().status(),
        StatusCode::FORBIDDEN
    );

    // A PUT URL signed for one size cannot be stretched to another.
    let stretched = put_url.url.replace(
        &format!("size={}", pack.size),
        &format!("size={}", pack.size + 1),
    );
    let mut longer = pack.sink.clone();
    longer.push(0);
    assert_eq!(
        http.put(&stretched)
            .body(longer)
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::FORBIDDEN
    );
}

#[tokio::test]
async fn uploads_that_do_not_match_their_signature_are_refused_and_not_stored() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let http = http();
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;
    let pack = build_pack(&keys_of(&begin), PackKind::Data, &[&[5u8; 4096]]);
    let url = prepare(&mut client, &ws.id, &[&pack]).await.remove(0).url;
    let key = format!(
        "packs/{}/{}/{}",
        begin.tenant,
        &pack.id.as_str()[..2],
        pack.id
    );

    let mut same_size = pack.sink.clone();
    let last = same_size.len() - 1;
    same_size[last] ^= 0xff;
    let mut longer = pack.sink.clone();
    longer.extend_from_slice(b"extra");
    let shorter = pack.sink[..pack.sink.len() - 1].to_vec();
    for (what, body) in [
        ("flipped byte", same_size),
        ("longer", longer),
        ("shorter", shorter),
    ] {
        let response = http.put(&url).body(body).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{what}");
        assert!(!server.object_file(&key).exists(), "{what}: nothing stored");
        assert_eq!(server.temp_files(), 0, "{what}: no partial upload left");
    }

    // Nothing is readable either, and a commit naming the pack is refused.
    let signer_key: [u8; 32] = std::fs::read(dir.path().join("url-signing.key"))
        .unwrap()
        .try_into()
        .unwrap();
    let get = UrlSigner::new(&signer_key).sign_query(
        &ObjectKey::new(key.clone()).unwrap(),
        &Grant::Get,
        unix_now() + 60,
        None,
    );
    let read = http
        .get(format!("{}/o/{key}?{get}", server.blob_url))
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), StatusCode::NOT_FOUND);

    // The right bytes are accepted, and uploading them again is harmless.
    for _ in 0..2 {
        assert_eq!(
            http.put(&url)
                .body(pack.sink.clone())
                .send()
                .await
                .unwrap()
                .status(),
            StatusCode::OK
        );
    }
    assert_eq!(std::fs::read(server.object_file(&key)).unwrap(), pack.sink);
}

#[tokio::test]
async fn the_health_endpoint_needs_no_signature() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let response = http()
        .get(format!("{}/healthz", server.blob_url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn upload_urls_are_refused_for_bad_pack_ids_and_sizes() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    for (pack_id, size, field) in [
        ("not-hex", 10, "pack_id"),
        (&"a".repeat(64)[..], 0, "bytes"),
        (&"a".repeat(64)[..], 2 << 30, "bytes"),
    ] {
        let status = client
            .checkpoints
            .prepare_uploads(pb::PrepareUploadsRequest {
                workspace: ws.id.clone(),
                packs: vec![pb::PackUpload {
                    pack_id: pack_id.into(),
                    size,
                    kind: pb::PackKind::Data as i32,
                }],
            })
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{pack_id} {size}"
        );
        assert!(status.message().contains(field), "{}", status.message());
    }
}
