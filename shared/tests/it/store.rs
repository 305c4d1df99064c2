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
