//! Fencing: once a run's next attempt is assigned, the superseded runner can
//! neither commit checkpoints nor report, so newer work stays newest. A run
//! token works only while its attempt is current: superseded, ended or
//! cancelled, it is refused on every service, and so are the URLs signed for
//! it.

use std::time::Duration;

use cairn_proto::domain::PackKind;
use cairn_proto::ids::Generation;
use cairn_proto::pb;
use cairn_proto::refusal::{NotCurrent, Refusal};
use reqwest::StatusCode;
use tonic::Code;

use crate::fleet::*;
use crate::harness::*;

#[tokio::test]
async fn a_superseded_runner_can_neither_commit_nor_report() {
    let (server, mut clients, mut a) = patient_fleet("a", 1).await;
    let run = clients.create_run(&[]).await;
    let (first, mut stale) = a.launch(&server, &run.id).await;
    let spec = stale.start().await;
    let workspace = run.workspace_id.clone();
    let early = checkpoint(&mut stale.coordinator, &workspace, b"attempt one, turn one").await;
    assert_eq!(early.generation, spec.generation);

    // The stale runner starts a checkpoint and uploads it while still current…
    let stale_begin = begin(&mut stale.coordinator, &workspace).await;
    assert_eq!(stale_begin.generation, first.generation);
    let keys = keys_of(&stale_begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"stale tree"]);
    let data = build_pack(&keys, PackKind::Data, &[b"stale work"]);
    upload(&mut stale.coordinator, &workspace, &[&meta, &data]).await;

    // …then its host is drained and the run moves to b as attempt 2.
    clients.host_request("drain", &a.id).await.unwrap();
    a.beat().await;
    a.sandbox_gone(&first.sandbox_id, pb::SandboxState::Destroyed, 0);
    a.beat().await;
    let mut b = FakeHost::register(&server, &server.admin_token, "b", &[], 1).await;
    let second = b.beat_until_assigned(&run.id).await;
    assert!(second.generation > first.generation);
    let mut current = FakeRunner::connect(&server, &second).await;
    current.claim().await;

    // The stale token is refused at the door on every service, typed, and
    // nothing is recorded.
    let both = [&meta, &data];
    let stale_commit = commit_request(&stale_begin, &meta, &both, &both);
    let refused = commit_err(&mut stale.coordinator, stale_commit.clone()).await;
    assert_not_current(&refused, &run.id, 1, NotCurrent::Superseded);
    let begin_refused = stale
        .coordinator
        .checkpoints
        .begin_checkpoint(pb::BeginCheckpointRequest {
            workspace: workspace.clone(),
            generation: 0,
        })
        .await
        .unwrap_err();
    assert_not_current(&begin_refused, &run.id, 1, NotCurrent::Superseded);
    let report_refused = stale
        .progress(pb::AttemptPhase::Checkpointed, "", &early.id)
        .await
        .unwrap_err();
    assert_not_current(&report_refused, &run.id, 1, NotCurrent::Superseded);
    let read_refused = stale
        .coordinator
        .workspaces
        .get_workspace(pb::GetWorkspaceRequest {
            workspace: workspace.clone(),
        })
        .await
        .unwrap_err();
    assert_not_current(&read_refused, &run.id, 1, NotCurrent::Superseded);

    // Generations still fence a current token: the current attempt cannot
    // commit at the old attempt's generation.
    let fenced = commit_err(&mut current.coordinator, stale_commit).await;
    assert_eq!(fenced.code(), Code::FailedPrecondition);
    assert_eq!(
        Refusal::of(&fenced),
        Some(Refusal::StaleGeneration {
            given: Generation(first.generation),
            current: Generation(second.generation),
        })
    );
    assert_eq!(
        fenced.message(),
        format!(
            "attempt 2 of run {} checkpoints at generation g{}, not g{}",
            run.id, second.generation, first.generation
        )
    );

    // The current attempt commits, and its checkpoint is the newest.
    let newer = checkpoint(&mut current.coordinator, &workspace, b"attempt two").await;
    assert_eq!(newer.generation, second.generation);
    let listed = list_checkpoints(&mut server.client().await, &workspace).await;
    let ids: Vec<_> = listed.iter().map(|c| c.id.clone()).collect();
    assert_eq!(ids, [newer.id.clone(), early.id.clone()]);
}

/// Asserts `status` refuses a run token whose attempt is not current.
fn assert_not_current(status: &tonic::Status, run: &str, attempt: u32, why: NotCurrent) {
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    match Refusal::of(status) {
        Some(Refusal::AttemptNotCurrent {
            run: refused_run,
            attempt: refused_attempt,
            why: refused_why,
        }) => {
            assert_eq!(
                (refused_run.as_str(), refused_attempt, refused_why),
                (run, attempt, why),
                "{status:?}"
            );
        }
        other => panic!("expected AttemptNotCurrent, got {other:?} in {status:?}"),
    }
}

/// Every call a runner makes, with its run token: the first refusal, if any.
async fn runner_calls(runner: &mut FakeRunner, workspace: &str) -> Vec<tonic::Status> {
    let mut refused = Vec::new();
    let begin = runner
        .coordinator
        .checkpoints
        .begin_checkpoint(pb::BeginCheckpointRequest {
            workspace: workspace.into(),
            generation: 0,
        })
        .await;
    refused.extend(begin.err());
    let manifest = runner
        .coordinator
        .checkpoints
        .get_restore_manifest(pb::GetRestoreManifestRequest {
            workspace: workspace.into(),
            ..Default::default()
        })
        .await;
    // A workspace without a checkpoint answers NOT_FOUND to a current token.
    refused.extend(manifest.err().filter(|s| s.code() != Code::NotFound));
    let find = runner
        .coordinator
        .checkpoints
        .find_missing_blobs(pb::FindMissingBlobsRequest {
            workspace: workspace.into(),
            ..Default::default()
        })
        .await;
    refused.extend(find.err());
    let progress = runner.progress(pb::AttemptPhase::Running, "", "").await;
    refused.extend(progress.err());
    refused
}

#[tokio::test]
async fn a_cancelled_run_s_token_works_through_its_orderly_end_and_then_never() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (assignment, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    let workspace = run.workspace_id.clone();

    clients.cancel(&run.id, "wrong task").await;
    host.beat().await;
    assert_eq!(
        host.destroy_order(&assignment.sandbox_id),
        Some("cancelled")
    );
    // The grace period: the runner cuts its destroy checkpoint and reports.
    let destroy = checkpoint(&mut runner.coordinator, &workspace, b"work at the cancel").await;
    runner
        .progress(pb::AttemptPhase::Checkpointed, "destroy", &destroy.id)
        .await
        .unwrap();
    runner.outcome(pb::Outcome::Interrupted, &[]).await.unwrap();
    assert!(runner_calls(&mut runner, &workspace).await.is_empty());

    // The sandbox is gone: the attempt ended, and its token is refused everywhere.
    host.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Destroyed, -15);
    host.beat().await;
    let refused = runner_calls(&mut runner, &workspace).await;
    assert_eq!(refused.len(), 4, "{refused:?}");
    for status in &refused {
        assert_not_current(status, &run.id, 1, NotCurrent::Cancelled);
    }
    let read = runner
        .coordinator
        .workspaces
        .get_workspace(pb::GetWorkspaceRequest {
            workspace: workspace.clone(),
        })
        .await
        .unwrap_err();
    assert_not_current(&read, &run.id, 1, NotCurrent::Cancelled);
    let newest = list_checkpoints(&mut server.client().await, &workspace).await;
    assert_eq!(
        newest[0].id, destroy.id,
        "nothing after the end was recorded"
    );
}

#[tokio::test]
async fn a_finished_attempt_s_token_and_its_urls_are_refused() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (_assignment, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    let workspace = run.workspace_id.clone();

    // While current, the runner gets URLs that work.
    let done = checkpoint(&mut runner.coordinator, &workspace, b"the end").await;
    let manifest = manifest(&mut runner.coordinator, &workspace, "").await;
    let get_url = manifest.packs[0].url.clone();
    assert!(
        get_url.contains(&format!("run={}&attempt=1", run.id)),
        "{get_url}"
    );
    let begin = begin(&mut runner.coordinator, &workspace).await;
    let keys = keys_of(&begin);
    let late = build_pack(&keys, PackKind::Data, &[b"written after the end"]);
    let put_url = prepare(&mut runner.coordinator, &workspace, &[&late])
        .await
        .remove(0)
        .url;
    let http = reqwest::Client::new();
    assert_eq!(
        http.get(&get_url).send().await.unwrap().status(),
        StatusCode::OK
    );
    // A URL handed to an admin token is bound to no attempt.
    let admin_manifest = manifest_of_admin(&server, &workspace).await;
    let admin_url = admin_manifest.packs[0].url.clone();
    assert!(!admin_url.contains("attempt="), "{admin_url}");

    runner
        .progress(pb::AttemptPhase::Checkpointed, "", &done.id)
        .await
        .unwrap();
    runner.outcome(pb::Outcome::Succeeded, &[]).await.unwrap();

    let refused = runner_calls(&mut runner, &workspace).await;
    assert_eq!(refused.len(), 4, "{refused:?}");
    for status in &refused {
        assert_not_current(status, &run.id, 1, NotCurrent::Ended);
    }
    let again = runner
        .outcome(pb::Outcome::Succeeded, &[])
        .await
        .unwrap_err();
    assert_not_current(&again, &run.id, 1, NotCurrent::Ended);

    // Its URLs follow within the blob server's cache of the answer.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let read = http.get(&get_url).send().await.unwrap();
    assert_eq!(read.status(), StatusCode::FORBIDDEN);
    let body = read.text().await.unwrap();
    assert!(
        body.contains("attempt 1") && body.contains("ended"),
        "the refusal says why: {body}"
    );
    let head = http.head(&get_url).send().await.unwrap();
    assert_eq!(head.status(), StatusCode::FORBIDDEN);
    let write = http
        .put(&put_url)
        .body(late.sink.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(write.status(), StatusCode::FORBIDDEN);
    let key = put_url
        .split("/o/")
        .nth(1)
        .and_then(|rest| rest.split('?').next())
        .unwrap();
    assert!(!server.object_file(key).exists(), "nothing was stored");
    // The admin's URL of the same pack still reads.
    assert_eq!(
        http.get(&admin_url).send().await.unwrap().status(),
        StatusCode::OK
    );
}

async fn manifest_of_admin(server: &TestServer, workspace: &str) -> pb::RestoreManifest {
    manifest(&mut server.client().await, workspace, "").await
}
