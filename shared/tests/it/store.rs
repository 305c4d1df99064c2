use batchfleet_shared::store::{ItemFailure, ItemStats, JobRecord, JobStatus};

fn record(id: &str) -> JobRecord {
    JobRecord {
        id: id.into(),
        name: "t".into(),
        status: JobStatus::Running,
        pool: "p".into(),
        manifest: "/m".into(),
        output_dir: "/o".into(),
        output_format: "csv".into(),
        model: "/m.pt".into(),
        model_sha256: "ab".into(),
        max_failed_items: None,
        max_failed_percent: None,
        items_total: 3,
        rows_total: 300,
        items_done: 0,
        rows_done: 0,
        rows_rejected: 0,
        created_ms: 1,
        published_ms: 0,
        finished_ms: 0,
        items_published: 0,
        merge: false,
    }
}

fn stats(seq: u32, worker: &str) -> ItemStats {
    ItemStats {
        seq,
        rows: 100,
        rows_rejected: 0,
        worker: worker.into(),
        started_ms: 1,
        finished_ms: 2,
        attempt: 1,
        recovered: false,
        rows_resumed: 0,
    }
}

#[tokio::test]
async fn concurrent_commits_of_one_item_count_once() {
    let store = crate::store("bftest-store").await;
    store.put_job(&record("j")).await.expect("put");
    let commits = (0..16).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .commit_item("j", &stats(1, &format!("w{i}")), &[vec![1, 2, 3]])
                .await
                .expect("commit")
        })
    });
    let mut winners = 0;
    for c in commits {
        winners += usize::from(c.await.expect("task"));
    }
    assert_eq!(winners, 1, "exactly one commit wins");
    assert_eq!(
        store.histogram("j", 3).await.expect("histogram"),
        vec![vec![1, 2, 3]],
        "the histogram of the winning commit only"
    );
    let p = store.progress("j").await.expect("progress");
    assert_eq!((p.items_done, p.rows_done, p.items_total), (1, 100, 3));
    assert_eq!(store.item_stats("j").await.expect("stats").len(), 1);
    assert!(store.is_done("j", 1).await.expect("done"));
    assert!(!store.is_done("j", 2).await.expect("done"));
    store.delete_job("j").await.expect("cleanup");
}

#[tokio::test]
async fn failures_settle_a_job_but_never_override_a_commit() {
    let store = crate::store("bftest-fail").await;
    store.put_job(&record("j")).await.expect("put");
    let failure = |seq| ItemFailure {
        seq,
        class: "poison".into(),
        reason: "bad row".into(),
        worker: "w".into(),
        attempt: 1,
        at_ms: 5,
    };
    store
        .commit_item("j", &stats(0, "w"), &[])
        .await
        .expect("commit");
    assert!(
        !store.fail_item("j", &failure(0)).await.expect("fail"),
        "a committed item cannot fail later"
    );
    assert!(store.fail_item("j", &failure(1)).await.expect("fail"));
    let p = store.progress("j").await.expect("progress");
    assert_eq!((p.items_done, p.items_failed), (1, 1));
    assert!(!p.settled());
    // A later successful commit of a failed item replaces the failure.
    store
        .commit_item("j", &stats(1, "w"), &[])
        .await
        .expect("commit");
    store.fail_item("j", &failure(2)).await.expect("fail");
    let p = store.progress("j").await.expect("progress");
    assert_eq!((p.items_done, p.items_failed), (2, 1));
    assert!(p.settled());
    assert_eq!(
        store
            .failures("j")
            .await
            .expect("failures")
            .iter()
            .map(|f| f.seq)
            .collect::<Vec<_>>(),
        vec![2]
    );
    store.clear_failures("j").await.expect("clear");
    assert_eq!(store.progress("j").await.expect("progress").items_failed, 0);
    store.delete_job("j").await.expect("cleanup");
}

#[tokio::test]
async fn starting_an_item_leases_counts_and_gates_in_one_call_and_a_commit_drops_the_lease() {
    use batchfleet_shared::store::Lease;
    let store = crate::store("bftest-start").await;
    store.put_job(&record("j")).await.expect("put");
    let lease = |seq, worker: &str| Lease {
        seq,
        worker: worker.into(),
        attempt: 1,
        started_ms: 1,
        heartbeat_ms: 1,
        ttl_ms: 15_000,
        rows_done: 0,
        rows: 100,
        rows_resumed: 0,
        acked: false,
    };
    let gate = store.start_item("j", &lease(0, "w")).await.expect("start");
    let gate = gate.expect("not done: started");
    assert!(!gate.failed);
    assert_eq!(gate.status, Some(JobStatus::Running));
    assert_eq!(
        store.leases("j").await.expect("leases"),
        vec![lease(0, "w")]
    );
    assert_eq!(
        store.work("j").await.expect("work").0,
        1,
        "delivery counted"
    );
    // A commit of the item drops its committer's lease, and nothing starts it again.
    assert!(store
        .commit_item("j", &stats(0, "w"), &[])
        .await
        .expect("commit"));
    assert!(store.leases("j").await.expect("leases").is_empty());
    assert_eq!(
        store.start_item("j", &lease(0, "w2")).await.expect("start"),
        None
    );
    assert!(store.leases("j").await.expect("leases").is_empty());
    assert_eq!(
        store.work("j").await.expect("work").0,
        1,
        "no delivery counted for a done item"
    );
    // A copy of an item that failed for good sees it, as it sees a failed job.
    let failure = ItemFailure {
        seq: 1,
        class: "poison".into(),
        reason: "bad row".into(),
        worker: "w".into(),
        attempt: 1,
        at_ms: 5,
    };
    store.fail_item("j", &failure).await.expect("fail");
    store
        .set_job_fields("j", &[("status", JobStatus::Failed.as_str().to_owned())])
        .await
        .expect("status");
    let gate = store.start_item("j", &lease(1, "w")).await.expect("start");
    assert_eq!(
        gate.map(|g| (g.failed, g.status)),
        Some((true, Some(JobStatus::Failed)))
    );
    store.delete_job("j").await.expect("cleanup");
}
