//! Fencing: once a run's next attempt is assigned, the superseded runner can
//! neither commit checkpoints nor report, so newer work stays newest.

use cairn_proto::domain::PackKind;
use cairn_proto::ids::Generation;
use cairn_proto::pb;
use cairn_proto::refusal::{NotCurrent, Refusal};
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

    // The stale commit is refused and nothing is recorded.
    let both = [&meta, &data];
    let stale_commit = commit_request(&stale_begin, &meta, &both, &both);
    let refused = commit_err(&mut stale.coordinator, stale_commit.clone()).await;
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(
        Refusal::of(&refused),
        Some(Refusal::StaleGeneration {
            given: Generation(first.generation),
            current: Generation(second.generation),
        })
    );
    assert_eq!(
        refused.message(),
        format!(
            "generation g{} is older than the workspace's g{}",
            first.generation, second.generation
        )
    );
    // "The current generation" of a stale run token is its attempt's, not the workspace's.
    let begin_refused = stale
        .coordinator
        .checkpoints
        .begin_checkpoint(pb::BeginCheckpointRequest {
            workspace: workspace.clone(),
            generation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(begin_refused.code(), Code::FailedPrecondition);
    assert!(matches!(
        Refusal::of(&begin_refused),
        Some(Refusal::StaleGeneration { .. })
    ));
    assert!(
        begin_refused.message().contains("older"),
        "{}",
        begin_refused.message()
    );
    // Claiming the newer generation outright does not work either.
    let forged = pb::CommitCheckpointRequest {
        generation: second.generation,
        ..stale_commit
    };
    let forged_refused = commit_err(&mut stale.coordinator, forged).await;
    assert_eq!(forged_refused.code(), Code::FailedPrecondition);
    assert_eq!(
        Refusal::of(&forged_refused),
        Some(Refusal::StaleGeneration {
            given: Generation(second.generation),
            current: Generation(first.generation),
        }),
        "the attempt's own generation is the current one for its token"
    );
    assert_eq!(
        forged_refused.message(),
        format!(
            "attempt 1 of run {} checkpoints at generation g{}, not g{}",
            run.id, first.generation, second.generation
        )
    );
    let report_refused = stale
        .progress(pb::AttemptPhase::Checkpointed, "", &early.id)
        .await
        .unwrap_err();
    assert_eq!(report_refused.code(), Code::PermissionDenied);
    assert_eq!(
        Refusal::of(&report_refused),
        Some(Refusal::AttemptNotCurrent {
            run: run.id.parse().unwrap(),
            attempt: 1,
            why: NotCurrent::Superseded,
        })
    );
    assert_eq!(
        report_refused.message(),
        format!("attempt 1 of run {} was superseded by attempt 2", run.id)
    );

    // The current attempt commits, and its checkpoint is the newest.
    let newer = checkpoint(&mut current.coordinator, &workspace, b"attempt two").await;
    assert_eq!(newer.generation, second.generation);
    let listed = list_checkpoints(&mut server.client().await, &workspace).await;
    let ids: Vec<_> = listed.iter().map(|c| c.id.clone()).collect();
    assert_eq!(ids, [newer.id.clone(), early.id.clone()]);
}
