//! TLS (issue 28): gRPC and the blob server behind the coordinator's
//! certificate, clients trusting only the CA in `CAIRN_CA`, and mutual TLS
//! for hosts — a host without a certificate of the client CA registers
//! nothing, while runners in its sandboxes connect with their run tokens
//! and the CA the host hands them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use cairn_e2e::fleet::{Fleet, HostOptions, state_of_host};
use cairn_e2e::tls::TlsFiles;
use cairn_e2e::{
    Coordinator, assert_trees_equal, binary, block_on, json_u64, populate_small_workspace, port_of,
    run, tempdir, write,
};
use cairn_engine::tls::ClientTls;
use cairn_proto::pb;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::refusal::Refusal;
use cairn_proto::runs::{HostState, RunState};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Whether the server closed `stream` within `within` (EOF or reset).
fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    stream
        .set_read_timeout(Some(within))
        .expect("a read timeout can be set");
    let mut buf = [0u8; 512];
    let deadline = Instant::now() + within;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            // A TLS alert or the like: keep reading until the close.
            Ok(_) if Instant::now() < deadline => continue,
            Ok(_) => return false,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
            }
        }
    }
}

#[test]
fn grpc_and_blobs_go_over_tls_and_clients_trust_only_the_given_ca() {
    let certs = tempdir("tls-certs");
    let files = TlsFiles::generate(certs.path());
    let coordinator = Coordinator::start_tls(
        &files,
        false,
        &[
            "--blob-header-timeout",
            "2s",
            "--grpc-handshake-timeout",
            "2s",
        ],
    );
    assert!(
        coordinator.grpc_url().starts_with("https://")
            && coordinator.blob_url().starts_with("https://"),
        "endpoints.json names https URLs: {} {}",
        coordinator.grpc_url(),
        coordinator.blob_url()
    );

    // A checkpoint and a restore, both through TLS (gRPC and signed URLs).
    let workspace = coordinator.create_workspace("over-tls");
    let client = coordinator.client();
    let tmp = tempdir("tls-work");
    let root = tmp.path().join("ws");
    populate_small_workspace(&root, 28);
    let cut = client.checkpoint(&root, &workspace);
    assert!(
        json_u64(&cut, "stats.uploaded_bytes") > 1 << 20,
        "the packs went up over https: {cut}"
    );
    let restored = tmp.path().join("restored");
    client.restore(&restored, &workspace);
    assert_trees_equal(&root, &restored);

    // Without CAIRN_CA the public roots are trusted, which do not include
    // the test CA; with another CA's bundle the certificate is refused too.
    for (label, ca) in [("no CAIRN_CA", None), ("another CA", Some(&files.rogue_ca))] {
        let mut ctl = client.ctl();
        match ca {
            Some(ca) => ctl.env("CAIRN_CA", ca),
            None => ctl.env_remove("CAIRN_CA"),
        };
        let outcome = run(ctl.args(["workspace", "list"]));
        assert!(
            !outcome.status.success() && outcome.all_output().contains("UnknownIssuer"),
            "{label}: cairnctl must refuse the coordinator's certificate, naming why: {outcome}"
        );
    }
    // A bundle that is not a certificate is refused with its path.
    let outcome = run(client
        .ctl()
        .env("CAIRN_CA", &files.server_key)
        .args(["workspace", "list"]));
    assert!(
        !outcome.status.success()
            && outcome.all_output().contains("holds no certificate")
            && outcome
                .all_output()
                .contains(&files.server_key.display().to_string()),
        "a key given as CAIRN_CA: {outcome}"
    );

    block_on(async {
        // Health answers over TLS without a token.
        let probe = cairn_engine::client::CoordinatorClient::connect_with(
            coordinator.grpc_url(),
            None,
            &coordinator.client_tls(),
        )
        .await
        .expect("the health probe connects over TLS");
        let health = HealthClient::new(probe.auth_channel())
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("health answers without a token over TLS")
            .into_inner();
        assert_eq!(health.status, ServingStatus::Serving as i32);

        // Plain HTTP/2 to the TLS port gets no gRPC answer.
        let plain = format!("http://127.0.0.1:{}", port_of(coordinator.grpc_url()));
        let plain_result = match cairn_engine::client::CoordinatorClient::connect_with(
            &plain,
            None,
            &ClientTls::default(),
        )
        .await
        {
            Ok(client) => HealthClient::new(client.auth_channel())
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .map(drop)
                .map_err(|s| s.to_string()),
            Err(e) => Err(e.to_string()),
        };
        assert!(
            plain_result.is_err(),
            "plaintext gRPC must not be answered on the TLS port"
        );

        // The blob server: https with the CA answers, plain HTTP does not.
        cairn_engine::transfer::install_crypto_provider();
        let https = reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(
                reqwest::Certificate::from_pem(&std::fs::read(&files.ca).unwrap()).unwrap(),
            )
            .build()
            .unwrap();
        let ok = https
            .get(format!("{}/healthz", coordinator.blob_url()))
            .send()
            .await
            .expect("the blob server answers over https");
        assert!(ok.status().is_success(), "{ok:?}");
        let plain_blob = format!(
            "http://127.0.0.1:{}/healthz",
            port_of(coordinator.blob_url())
        );
        let refused = reqwest::Client::new().get(&plain_blob).send().await;
        assert!(
            refused.is_err() || !refused.as_ref().unwrap().status().is_success(),
            "plain HTTP must not be served on the TLS blob port: {refused:?}"
        );
    });

    // Peers that open connections and never finish a handshake hold no one
    // up, and are cut at the header / handshake deadline (2 s here).
    let addresses = [
        format!("127.0.0.1:{}", port_of(coordinator.blob_url())),
        format!("127.0.0.1:{}", port_of(coordinator.grpc_url())),
    ];
    let mut stalled: Vec<TcpStream> = Vec::new();
    for address in &addresses {
        for i in 0..40 {
            let mut stream = TcpStream::connect(address).expect("the listener accepts");
            if i % 2 == 0 {
                // Half of them start a ClientHello and stop.
                stream.write_all(&[0x16, 0x03, 0x01, 0x02]).unwrap();
            }
            stalled.push(stream);
        }
    }
    write(
        &root.join("src/after-stall.rs"),
        "// written while peers stall\n",
    );
    let second = client.checkpoint(&root, &workspace);
    assert_eq!(
        json_u64(&second, "sequence"),
        2,
        "a checkpoint goes through while 80 handshakes stall: {second}"
    );
    for (i, stream) in stalled.iter_mut().enumerate() {
        assert!(
            closed_within(stream, Duration::from_secs(20)),
            "stalled connection {i} was not closed after the handshake deadline"
        );
    }
}

#[test]
fn hosts_need_a_certificate_of_the_client_ca_and_their_sandboxes_trust_the_ca() {
    let certs = tempdir("mtls-certs");
    let files = TlsFiles::generate(certs.path());
    let mut fleet = Fleet::start_tls(&files, true);

    // A host token's call over a connection without a certificate is
    // refused with the typed reason, before any host is registered.
    let refusal = block_on(async {
        let admin = fleet.coordinator.admin().await;
        let status = HostServiceClient::new(admin.auth_channel())
            .register_host(pb::RegisterHostRequest {
                name: "no-certificate".into(),
                slots: 1,
                driver: "local".into(),
                ..Default::default()
            })
            .await
            .expect_err("RegisterHost without a client certificate must be refused");
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        Refusal::of(&status)
    });
    assert_eq!(refusal, Some(Refusal::ClientCertificateRequired));

    // cairn-host without a certificate says why and stops.
    let lonely = tempdir("host-without-certificate");
    let outcome = run(std::process::Command::new(binary("cairn-host"))
        .arg("--coordinator")
        .arg(fleet.coordinator.grpc_url())
        .arg("--data-dir")
        .arg(lonely.path().join("data"))
        .args(["--name", "no-cert"])
        .env("CAIRN_TOKEN", fleet.coordinator.admin_token())
        .env("CAIRN_CA", &files.ca)
        .env_remove("CAIRN_COORDINATOR"));
    assert!(
        !outcome.status.success() && outcome.all_output().contains("client certificate"),
        "cairn-host without a certificate must stop naming the cause: {outcome}"
    );

    // A certificate of another CA is refused in the handshake: the host
    // never registers.
    let mut impostor = std::process::Command::new(binary("cairn-host"));
    let impostor_dir = tempdir("impostor-host");
    let mut impostor = impostor
        .arg("--coordinator")
        .arg(fleet.coordinator.grpc_url())
        .arg("--data-dir")
        .arg(impostor_dir.path().join("data"))
        .args(["--name", "impostor"])
        .arg("--tls-client-cert")
        .arg(&files.rogue_host_cert)
        .arg("--tls-client-key")
        .arg(&files.rogue_host_key)
        .env("CAIRN_TOKEN", fleet.coordinator.admin_token())
        .env("CAIRN_CA", &files.ca)
        .env_remove("CAIRN_COORDINATOR")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("cairn-host starts");

    // The real host: its certificate chains to the client CA.
    fleet.start_host(
        "a",
        HostOptions {
            client_certificate: Some((files.host_cert.clone(), files.host_key.clone())),
            ..HostOptions::default()
        },
    );
    assert_eq!(state_of_host(&fleet.host_info("a")), Some(HostState::Ready));

    // A run on it: the runner in the sandbox reaches the coordinator and
    // the blob server over TLS with its run token and the CA the host
    // handed it (it has no certificate of its own).
    let created =
        fleet.create_run(fleet.run_request("tls-run", "commit notes/tls.txt written over TLS"));
    let done = fleet.wait_for_state(&created.id, RunState::Succeeded);
    let newest = fleet.checkpoints(&done.workspace_id)[0].clone();
    let (_keep, checkout) = fleet.checkout(&done.workspace_id, &newest.id);
    assert_eq!(
        std::fs::read_to_string(checkout.join("notes/tls.txt")).unwrap(),
        "written over TLS\n"
    );

    let _ = impostor.kill();
    let _ = impostor.wait();
    assert!(
        fleet.list_hosts().iter().all(|h| h.name != "impostor"),
        "a host with another CA's certificate registered: {:?}",
        fleet.list_hosts()
    );
    assert!(
        fleet
            .coordinator
            .log_tail()
            .contains("TLS client certificate refused"),
        "the coordinator logs the refused certificate for its operator:\n{}",
        fleet.coordinator.log_tail()
    );
}

/// A renewed certificate is served without a restart; files that do not
/// load leave the old one in place.
#[test]
fn a_renewed_certificate_is_served_without_a_restart() {
    let certs = tempdir("tls-reload");
    let files = TlsFiles::generate(certs.path());
    // The coordinator reads copies, which the test then replaces.
    let served_cert = certs.path().join("served.pem");
    let served_key = certs.path().join("served.key");
    std::fs::copy(&files.server_cert, &served_cert).unwrap();
    std::fs::copy(&files.server_key, &served_key).unwrap();
    let coordinator = Coordinator::start_with(&[
        "--tls-cert",
        served_cert.to_str().unwrap(),
        "--tls-key",
        served_key.to_str().unwrap(),
        "--tls-reload-interval",
        "100ms",
    ]);
    let list_trusting = |ca: &std::path::Path| {
        run(coordinator
            .client()
            .ctl()
            .env("CAIRN_CA", ca)
            .args(["workspace", "list"]))
    };
    list_trusting(&files.ca).assert_success();

    // Renewed by another CA: clients of the old CA are refused, clients of
    // the new one served, with no restart.
    std::fs::copy(&files.other_server_cert, &served_cert).unwrap();
    std::fs::copy(&files.other_server_key, &served_key).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !list_trusting(&files.rogue_ca).status.success() {
        assert!(
            Instant::now() < deadline,
            "the renewed certificate is not served:\n{}",
            coordinator.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let old = list_trusting(&files.ca);
    assert!(
        !old.status.success() && old.all_output().contains("UnknownIssuer"),
        "{old}"
    );

    // A key that does not belong to the certificate: the last good pair
    // stays, and the coordinator says why.
    std::fs::copy(&files.server_key, &served_key).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !coordinator
        .log_tail()
        .contains("still serving the old certificate")
    {
        assert!(
            Instant::now() < deadline,
            "a broken pair was not reported:\n{}",
            coordinator.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    list_trusting(&files.rogue_ca).assert_success();
}
