//! Every test body runs twice, against Redis (`redis::…`, its keys under a
//! prefix of its own) and against the in-process store (`local::…`): both
//! implementations of `JobStore` must behave the same.

use batchfleet_shared::store::{
    Claim, Commit, ItemFailure, ItemStats, JobFacts, JobRecord, JobStatus, Pace, RecordUpdate,
    Start, Store, UnableNote, Work,
};

/// Runs each `name: "redis key prefix stem"` test body against both stores.
macro_rules! on_both_stores {
    ($($name:ident: $stem:literal),* $(,)?) => {
        mod redis {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(crate::store($stem).await).await;
                }
            )*
        }
        mod local {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(batchfleet_shared::store::Store::local()).await;
                }
            )*
        }
    };
}

on_both_stores! {
    concurrent_commits_of_one_item_count_once: "bftest-store",
    failures_settle_a_job_but_never_override_a_commit: "bftest-fail",
    starting_an_item_checks_the_claim_leases_on_the_store_clock_and_a_commit_drops_the_lease: "bftest-start",
    a_message_disagreeing_with_its_job_record_writes_nothing: "bftest-claim",
    a_job_fails_once_with_its_first_reason_and_its_items_are_skipped: "bftest-failjob",
    a_cancelled_job_starts_heartbeats_and_commits_nothing_more: "bftest-cancel",
    one_follower_holds_the_lease_and_one_claim_reduces_each_run: "bftest-follow",
    inputs_are_recorded_by_path: "bftest-inputs",
    a_task_is_stored_once_per_job_under_its_digest: "bftest-tasks",
    a_group_commits_each_item_once_and_adds_only_the_winners: "bftest-group",
    a_sample_of_item_stats_holds_distinct_committed_items: "bftest-sample",
    a_job_s_facts_and_a_lease_written_at_the_first_heartbeat: "bftest-facts",
    workers_dying_on_an_item_are_counted_once_each_until_it_is_given_up: "bftest-crash",
    a_worker_stopped_while_draining_is_no_crash_of_its_items: "bftest-stopping",
    a_lease_written_once_lives_while_its_holder_beats: "bftest-beats",
    a_job_s_deadline_and_pace_are_kept_in_its_record: "bftest-pace",
}

fn record(id: &str) -> JobRecord {
    JobRecord {
        status: JobStatus::Running,
        ..JobRecord::sample(id)
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
        vector: None,
        shadow: None,
    }
}

async fn concurrent_commits_of_one_item_count_once(store: Store) {
    store.put_job(&record("j")).await.expect("put");
    // Every commit carries its worker's model rows: counted win or lose.
    let commits = (0..16).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let stats = stats(1, &format!("w{i}"));
            let commit = Commit {
                stats: &stats,
                histogram: &[vec![1, 2, 3]],
                leased: true,
            };
            store
                .commit_group(
                    "j",
                    &[commit],
                    Work {
                        deliveries: 0,
                        rows: 10,
                    },
                )
                .await
                .expect("commit")[0]
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
    assert_eq!(store.work("j").await.expect("work"), (0, 160));
    // Nothing to count sends nothing and changes nothing.
    store.count_work("j", 0, 0).await.expect("count");
    store.count_work("j", 0, 5).await.expect("count");
    assert_eq!(store.work("j").await.expect("work"), (0, 165));
    store.delete_job("j").await.expect("cleanup");
}

async fn failures_settle_a_job_but_never_override_a_commit(store: Store) {
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

fn lease(seq: u32, worker: &str) -> batchfleet_shared::store::Lease {
    batchfleet_shared::store::Lease {
        seq,
        worker: worker.into(),
        attempt: 1,
        // A worker's own clock, wrong on purpose: the store's clock replaces it.
        started_ms: 1,
        heartbeat_ms: 1,
        ttl_ms: 15_000,
        rows_done: 0,
        rows: 100,
        rows_resumed: 0,
        acked: false,
        // As a worker writes it: a lease goes through the scripts' JSON whole.
        boot: batchfleet_shared::store::boot_id(),
        stopping: false,
    }
}

/// What the messages of `record("j")` claim.
fn claim() -> Claim<'static> {
    Claim {
        pool: "p",
        model: "/m.pt",
        model_sha256: "ab",
        output_dir: "/o",
        returned: false,
    }
}

async fn starting_an_item_checks_the_claim_leases_on_the_store_clock_and_a_commit_drops_the_lease(
    store: Store,
) {
    store.put_job(&record("j")).await.expect("put");
    let before = store.now_ms().await.expect("time");
    let Start::Started { at_ms, crashes: 0 } = store
        .start_item("j", &lease(0, "w"), &claim())
        .await
        .expect("start")
    else {
        panic!("not started")
    };
    let after = store.now_ms().await.expect("time");
    assert!(
        before <= at_ms && at_ms <= after,
        "{before} {at_ms} {after}"
    );
    let leases = store.leases("j").await.expect("leases");
    assert_eq!(leases.len(), 1);
    assert_eq!(
        (leases[0].started_ms, leases[0].heartbeat_ms),
        (at_ms, at_ms),
        "lease times are the store's clock, not the worker's"
    );
    assert_eq!(leases[0].worker, "w");
    assert_eq!(
        store.work("j").await.expect("work").0,
        1,
        "delivery counted"
    );
    // A heartbeat moves heartbeat_ms on the store's clock too.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let mut beat = lease(0, "w");
    beat.started_ms = at_ms;
    beat.heartbeat_ms = 7;
    assert!(store.heartbeat("j", &beat, 0).await.expect("beat"));
    let leases = store.leases("j").await.expect("leases");
    assert!(leases[0].heartbeat_ms > at_ms, "{:?}", leases[0]);
    assert_eq!(leases[0].started_ms, at_ms);
    // A commit of the item drops its committer's lease, and nothing starts it again.
    assert!(store
        .commit_item("j", &stats(0, "w"), &[])
        .await
        .expect("commit"));
    assert!(store.leases("j").await.expect("leases").is_empty());
    assert_eq!(
        store
            .start_item("j", &lease(0, "w2"), &claim())
            .await
            .expect("start"),
        Start::Done
    );
    assert!(store.leases("j").await.expect("leases").is_empty());
    // A copy of an item that failed for good is stale; nothing is written.
    let failure = ItemFailure {
        seq: 1,
        class: "poison".into(),
        reason: "bad row".into(),
        worker: "w".into(),
        attempt: 1,
        at_ms: 5,
    };
    store.fail_item("j", &failure).await.expect("fail");
    assert_eq!(
        store
            .start_item("j", &lease(1, "w"), &claim())
            .await
            .expect("start"),
        Start::FailedForGood
    );
    assert_eq!(
        store.work("j").await.expect("work").0,
        1,
        "no delivery counted for a done or failed item"
    );
    store.delete_job("j").await.expect("cleanup");
}

async fn a_message_disagreeing_with_its_job_record_writes_nothing(store: Store) {
    store.put_job(&record("j")).await.expect("put");
    let start = |seq, claim: Claim<'static>| {
        let store = store.clone();
        async move {
            store
                .start_item("j", &lease(seq, "w"), &claim)
                .await
                .expect("start")
        }
    };
    for (c, field) in [
        (
            Claim {
                pool: "other",
                ..claim()
            },
            "pool",
        ),
        (
            Claim {
                model: "/etc/passwd",
                ..claim()
            },
            "model",
        ),
        (
            Claim {
                model_sha256: "cd",
                ..claim()
            },
            "model_sha256",
        ),
        (
            Claim {
                output_dir: "/tmp",
                ..claim()
            },
            "output_dir",
        ),
    ] {
        match start(0, c).await {
            Start::Mismatch { field: f, .. } => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    assert_eq!(
        start(3, claim()).await,
        Start::Mismatch {
            field: "items_total".into(),
            recorded: "3".into()
        }
    );
    assert_eq!(
        store
            .start_item("nope", &lease(0, "w"), &claim())
            .await
            .expect("start"),
        Start::UnknownJob
    );
    store
        .update_job(
            "j",
            &RecordUpdate::Finished {
                status: JobStatus::Completed,
                at_ms: 1,
            },
        )
        .await
        .expect("status");
    assert_eq!(
        start(1, claim()).await,
        Start::NotRunning(JobStatus::Completed)
    );
    assert!(store.leases("j").await.expect("leases").is_empty());
    assert_eq!(store.work("j").await.expect("work").0, 0, "nothing counted");
    store.delete_job("j").await.expect("cleanup");
}

async fn a_job_fails_once_with_its_first_reason_and_its_items_are_skipped(store: Store) {
    store.put_job(&record("j")).await.expect("put");
    assert!(store
        .fail_job("j", "unrunnable", "model /m.pt is a state_dict")
        .await
        .expect("fail"));
    assert!(!store
        .fail_job("j", "budget", "too many")
        .await
        .expect("fail"));
    let job = store.job("j").await.expect("job").expect("there");
    assert_eq!(job.status, JobStatus::Failed);
    assert_eq!(
        (job.failed_class.as_str(), job.failed_reason.as_str()),
        ("unrunnable", "model /m.pt is a state_dict")
    );
    assert_eq!(
        store.progress("j").await.expect("progress").status,
        Some(JobStatus::Failed)
    );
    assert_eq!(
        store
            .start_item("j", &lease(0, "w"), &claim())
            .await
            .expect("start"),
        Start::JobFailed
    );
    // Workers' notes and copy counts.
    let note = UnableNote {
        class: "unable".into(),
        reason: "no CUDA device".into(),
        since_ms: 1,
        until_ms: 2,
    };
    store.note_unable("j", "w1", &note).await.expect("note");
    assert_eq!(
        store.unable("j").await.expect("notes").get("w1"),
        Some(&note)
    );
    store.clear_unable_notes("j").await.expect("clear");
    assert!(store.unable("j").await.expect("notes").is_empty());
    assert_eq!(store.mark_redispatched("j", 2, 10).await.expect("mark"), 1);
    assert_eq!(store.mark_redispatched("j", 2, 11).await.expect("mark"), 2);
    assert_eq!(store.copies("j").await.expect("copies").get(&2), Some(&2));
    store.delete_job("j").await.expect("cleanup");
}

async fn a_cancelled_job_starts_heartbeats_and_commits_nothing_more(store: Store) {
    store.put_job(&record("c")).await.expect("put");
    let held = lease(1, "w");
    assert!(matches!(
        store.start_item("c", &held, &claim()).await.expect("start"),
        Start::Started { .. }
    ));
    assert!(store
        .commit_item("c", &stats(0, "w"), &[])
        .await
        .expect("commit"));
    assert!(store
        .fail_job("c", "cancelled", "by hand")
        .await
        .expect("cancel"));
    let job = store.job("c").await.expect("job").expect("there");
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(
        (job.failed_class.as_str(), job.failed_reason.as_str()),
        ("cancelled", "by hand")
    );
    // Cancelled once: a later failure or cancel changes nothing.
    assert!(!store
        .fail_job("c", "budget", "too many")
        .await
        .expect("fail"));
    assert!(!store
        .fail_job("c", "cancelled", "again")
        .await
        .expect("cancel"));
    // Queued items are skipped, an in-flight one's heartbeat is refused
    // (it stops), and its commit does not count.
    assert_eq!(
        store
            .start_item("c", &lease(2, "w"), &claim())
            .await
            .expect("start"),
        Start::JobFailed
    );
    assert!(!store.heartbeat("c", &held, 0).await.expect("heartbeat"));
    assert!(
        !store.is_done("c", 1).await.expect("done"),
        "not done: stopped by the cancel"
    );
    assert!(!store
        .commit_item("c", &stats(1, "w"), &[])
        .await
        .expect("commit"));
    let p = store.progress("c").await.expect("progress");
    assert_eq!((p.items_done, p.status), (1, Some(JobStatus::Cancelled)));
    store.delete_job("c").await.expect("cleanup");
}

async fn one_follower_holds_the_lease_and_one_claim_reduces_each_run(store: Store) {
    use std::time::Duration;
    store.put_job(&record("f")).await.expect("put");
    let ttl = Duration::from_secs(30);
    assert!(store.follow_lease("f", "a", ttl).await.expect("lease"));
    assert!(store.follow_lease("f", "a", ttl).await.expect("renew"));
    assert!(
        !store.follow_lease("f", "b", ttl).await.expect("lease"),
        "a holds it"
    );
    store
        .release_follow("f", "b")
        .await
        .expect("not b's to release");
    assert!(!store.follow_lease("f", "b", ttl).await.expect("lease"));
    store.release_follow("f", "a").await.expect("release");
    assert!(
        store.follow_lease("f", "b", ttl).await.expect("lease"),
        "given up by a"
    );
    // A lapsed lease is taken over — even after the job was run again
    // (its state persisted) or finished (its state given a retention).
    assert!(store
        .follow_lease("g", "a", Duration::from_millis(30))
        .await
        .expect("lease"));
    store.put_job(&record("g")).await.expect("put");
    store.persist_job("g").await.expect("persist");
    store
        .expire_job("g", Duration::from_secs(3600))
        .await
        .expect("expire");
    let lapsed = async {
        while !store.follow_lease("g", "b", ttl).await.expect("lease") {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), lapsed)
        .await
        .expect("lapsed");
    // One reduce claim per run: the first caller's, then nobody's.
    let stale = Duration::from_secs(600);
    assert!(store.claim_reduce("f", "a", stale).await.expect("claim"));
    assert!(store
        .claim_reduce("f", "a", stale)
        .await
        .expect("the claimer's again"));
    assert!(!store.claim_reduce("f", "b", stale).await.expect("claim"));
    // A stale claim on a job still unfinished is taken over.
    assert!(store
        .claim_reduce("f", "b", Duration::ZERO)
        .await
        .expect("stale"));
    // Reduced (final status, finish time): nobody claims it.
    store
        .update_job(
            "f",
            &RecordUpdate::Finished {
                status: JobStatus::Completed,
                at_ms: 5,
            },
        )
        .await
        .expect("finish");
    assert!(!store
        .claim_reduce("f", "b", Duration::ZERO)
        .await
        .expect("claim"));
    // Run again, it is claimed once more.
    store
        .update_job(
            "f",
            &RecordUpdate::Rerun {
                merge: false,
                max_crashes: 2,
                orphan_grace_ms: 10_000,
            },
        )
        .await
        .expect("again");
    assert!(store.claim_reduce("f", "c", stale).await.expect("claim"));
    assert!(!store.claim_reduce("f", "a", stale).await.expect("claim"));
    assert!(!store
        .claim_reduce("unknown", "a", stale)
        .await
        .expect("claim"));
    for id in ["f", "g"] {
        store.delete_job(id).await.expect("cleanup");
    }
}

async fn inputs_are_recorded_by_path(store: Store) {
    store.put_job(&record("i")).await.expect("put");
    let inputs: Vec<(String, String)> = (0..2500)
        .map(|n| (format!("/data/f{n:05}.csv"), format!("{{\"size\":{n}}}")))
        .collect();
    store.put_inputs("i", &inputs).await.expect("put inputs");
    let back = store.inputs("i").await.expect("inputs");
    assert_eq!(back.len(), 2500);
    assert_eq!(
        back.get("/data/f01234.csv").map(String::as_str),
        Some("{\"size\":1234}")
    );
    store.delete_job("i").await.expect("cleanup");
    assert!(store.inputs("i").await.expect("inputs").is_empty());
}

async fn a_group_commits_each_item_once_and_adds_only_the_winners(store: Store) {
    store.put_job(&record("g")).await.expect("put");
    assert!(store
        .commit_item("g", &stats(0, "early"), &[vec![5, 0, 0]])
        .await
        .expect("commit"));
    let (s0, s1, s1b, s2) = (stats(0, "w"), stats(1, "w"), stats(1, "w2"), stats(2, "w"));
    let hist = [vec![100, 100, 100]];
    let group = [
        Commit {
            stats: &s0,
            histogram: &hist, // done already: not added
            leased: true,
        },
        Commit {
            stats: &s1,
            histogram: &[vec![1, 0, 2]],
            leased: true,
        },
        Commit {
            stats: &s1b,
            histogram: &hist, // the same item twice in one group: the first wins
            leased: true,
        },
        Commit {
            stats: &s2,
            histogram: &[vec![0, 3, 1]],
            leased: true,
        },
    ];
    let work = |deliveries, rows| Work { deliveries, rows };
    let won = store
        .commit_group("g", &group, work(3, 7))
        .await
        .expect("group");
    assert_eq!(won, vec![false, true, false, true]);
    let p = store.progress("g").await.expect("progress");
    assert_eq!((p.items_done, p.rows_done), (3, 300));
    assert_eq!(
        store.histogram("g", 3).await.expect("histogram"),
        vec![vec![6, 3, 3]]
    );
    let winners: Vec<String> = store
        .item_stats("g")
        .await
        .expect("stats")
        .into_iter()
        .map(|s| format!("{}@{}", s.seq, s.worker))
        .collect();
    assert_eq!(winners.len(), 3);
    assert!(winners.contains(&"1@w".to_owned()), "{winners:?}");
    assert_eq!(store.work("g").await.expect("work"), (3, 7));
    // A cancelled job takes no commit, and still counts the work.
    store
        .fail_job("g", "cancelled", "by hand")
        .await
        .expect("cancel");
    let s3 = stats(3, "w");
    let late = [Commit {
        stats: &s3,
        histogram: &[],
        leased: true,
    }];
    assert_eq!(
        store
            .commit_group("g", &late, work(1, 2))
            .await
            .expect("group"),
        vec![false]
    );
    assert_eq!(store.work("g").await.expect("work"), (4, 9));
    assert_eq!(store.progress("g").await.expect("progress").items_done, 3);
    store.delete_job("g").await.expect("cleanup");
}

async fn a_sample_of_item_stats_holds_distinct_committed_items(store: Store) {
    store.put_job(&record("s")).await.expect("put");
    assert!(store
        .sample_item_stats("s", 4)
        .await
        .expect("sample")
        .is_empty());
    let stats: Vec<ItemStats> = (0..10).map(|i| stats(i, "w")).collect();
    let commits: Vec<Commit<'_>> = stats
        .iter()
        .map(|stats| Commit {
            stats,
            histogram: &[],
            leased: true,
        })
        .collect();
    store
        .commit_group("s", &commits, Work::default())
        .await
        .expect("commit");
    let some = store.sample_item_stats("s", 4).await.expect("sample");
    let seqs: std::collections::BTreeSet<u32> = some.iter().map(|s| s.seq).collect();
    assert_eq!((some.len(), seqs.len()), (4, 4), "{seqs:?}");
    assert!(seqs.iter().all(|s| *s < 10));
    let all = store.sample_item_stats("s", 100).await.expect("sample");
    assert_eq!(all.len(), 10, "never more than there are");
    store.delete_job("s").await.expect("cleanup");
}

/// A small task (a CSV layout, a model, an output folder).
fn sample_task() -> batchfleet_shared::message::TaskSpec {
    use batchfleet_shared::message::{
        CsvLayout, FailurePolicy, Layout, ModelRef, OutputSpec, TaskSpec,
    };
    TaskSpec {
        model: ModelRef::plain("/models/m.pt", "00".repeat(32), "cpu"),
        layout: Layout::Csv(CsvLayout {
            delimiter: b',',
            fields: 3,
            id_column: 0,
            feature_columns: vec![1, 2],
            include_columns: Vec::new(),
            missing: Default::default(),
            header: Vec::new(),
        }),
        batch_size: 64,
        auto_batch: false,
        output: OutputSpec {
            dir: "/data/out".into(),
            ..OutputSpec::default()
        },
        failure: FailurePolicy::default(),
        checkpoint_rows: 0,
        text: None,
        shadow: None,
    }
}

async fn a_task_is_stored_once_per_job_under_its_digest(store: Store) {
    use batchfleet_shared::message::StoredTask;
    use batchfleet_shared::store::TaskLookup;
    let item = sample_task();
    let task = StoredTask::of(&item);
    assert_eq!(
        store.task("t", &task.sha256).await.expect("task"),
        TaskLookup::UnknownJob
    );
    store.put_job(&record("t")).await.expect("put");
    assert_eq!(
        store.task("t", &task.sha256).await.expect("task"),
        TaskLookup::NotOfJob
    );
    store.put_task("t", &task).await.expect("put task");
    store
        .put_task("t", &task)
        .await
        .expect("stored again: no change");
    let TaskLookup::Found(bytes) = store.task("t", &task.sha256).await.expect("task") else {
        panic!("the task was stored");
    };
    assert_eq!(StoredTask::open(&bytes, &task.sha256).expect("opens"), item);
    // With the job's facts, in one round trip on Redis: what `task` says,
    // and the facts of a known job only.
    let facts = store.job_facts("t").await.expect("facts");
    assert!(facts.is_some());
    for (job, sha, want) in [
        ("t", task.sha256.as_str(), TaskLookup::Found(bytes.clone())),
        ("t", "0000", TaskLookup::NotOfJob),
        ("nope", task.sha256.as_str(), TaskLookup::UnknownJob),
    ] {
        let (found, got) = store.task_and_facts(job, sha).await.expect("task");
        assert_eq!(found, want);
        assert_eq!(got, if job == "t" { facts.clone() } else { None });
    }
    // Another job does not share it.
    store.put_job(&record("u")).await.expect("put");
    assert_eq!(
        store.task("u", &task.sha256).await.expect("task"),
        TaskLookup::NotOfJob
    );
    for id in ["t", "u"] {
        store.delete_job(id).await.expect("cleanup");
    }
    assert_eq!(
        store.task("t", &task.sha256).await.expect("task"),
        TaskLookup::UnknownJob
    );
}

#[tokio::test]
async fn sentinels_that_do_not_answer_are_named_without_their_passwords() {
    let endpoint = batchfleet_shared::endpoint::Endpoint::redis(
        batchfleet_shared::secret::SecretUrl::new("redis://:data-pw@127.0.0.1:1/"),
    )
    .with_sentinel(batchfleet_shared::endpoint::Sentinel::new(
        &[batchfleet_shared::secret::SecretUrl::new(
            "redis://:sentinel-pw@127.0.0.1:2,127.0.0.1:3",
        )],
        "bfprimary",
    ));
    let err = Store::connect(
        &endpoint,
        "sentinel-test",
        std::time::Duration::from_secs(5),
    )
    .await
    .expect_err("nothing listens on ports 1, 2 and 3");
    let text = format!("{err} {err:?}");
    assert!(
        text.contains("127.0.0.1:2") && text.contains("127.0.0.1:3"),
        "{text}"
    );
    assert!(text.contains("BATCHFLEET_REDIS_SENTINEL"), "{text}");
    assert!(
        !text.contains("sentinel-pw") && !text.contains("data-pw"),
        "{text}"
    );
}

/// What a worker checks a first delivery against without the start script
/// (the record's fields, read on their own), and the lease of such an item,
/// written only at its first heartbeat, starting when the worker took it.
async fn a_job_s_facts_and_a_lease_written_at_the_first_heartbeat(store: Store) {
    assert_eq!(store.job_facts("f").await.expect("facts"), None);
    store.put_job(&record("f")).await.expect("put");
    let facts = store.job_facts("f").await.expect("facts").expect("known");
    assert_eq!(facts, JobFacts::of(&record("f")));
    assert_eq!(
        (facts.status, facts.items_total, facts.pool.as_str()),
        (JobStatus::Running, 3, "p")
    );
    assert!(facts.admit(2, &claim()));
    assert!(!facts.admit(3, &claim()), "past the job's items");
    let other_model = Claim {
        model_sha256: "cd",
        ..claim()
    };
    assert!(!facts.admit(0, &other_model));
    // No lease until the first heartbeat, which dates it back by the time held.
    assert!(store.leases("f").await.expect("leases").is_empty());
    let now = store.now_ms().await.expect("clock");
    let mut late = lease(1, "w");
    late.started_ms = 0;
    assert!(store.heartbeat("f", &late, 5_000).await.expect("beat"));
    let leases = store.leases("f").await.expect("leases");
    assert_eq!(leases.len(), 1);
    let l = &leases[0];
    assert!(l.heartbeat_ms >= now, "{l:?}");
    assert_eq!(
        l.heartbeat_ms - l.started_ms,
        5_000,
        "started when the worker took the item, on the store's clock: {l:?}"
    );
    // Later beats keep that start.
    let mut again = l.clone();
    again.rows_done = 50;
    assert!(store.heartbeat("f", &again, 9_000).await.expect("beat"));
    let l2 = &store.leases("f").await.expect("leases")[0];
    assert_eq!((l2.started_ms, l2.rows_done), (l.started_ms, 50));
    // The commit of an item started without the start script: its delivery
    // counted with it, and no lease dropped nor failure forgotten when it
    // says it was never leased (here a lease is there only to show that
    // such a commit does not touch the leases).
    let s = stats(1, "w");
    let quick = [Commit {
        stats: &s,
        histogram: &[],
        leased: false,
    }];
    let won = store
        .commit_group(
            "f",
            &quick,
            Work {
                deliveries: 1,
                rows: 100,
            },
        )
        .await
        .expect("commit");
    assert_eq!(won, vec![true]);
    assert_eq!(store.work("f").await.expect("work"), (1, 100));
    assert_eq!(store.leases("f").await.expect("leases").len(), 1);
    assert!(
        !store.heartbeat("f", l2, 0).await.expect("beat"),
        "a done item is leased no more"
    );
    store
        .fail_job("f", "cancelled", "by hand")
        .await
        .expect("cancel");
    let facts = store.job_facts("f").await.expect("facts").expect("known");
    assert_eq!(facts.status, JobStatus::Cancelled);
    assert!(!facts.admit(0, &claim()), "a cancelled job starts nothing");
    store.delete_job("f").await.expect("cleanup");
}

/// The local Redis as a store under a key prefix of its own (returned), and
/// a plain connection to look at its keys as they are.
async fn redis_with_raw(stem: &str) -> (Store, String, ::redis::aio::MultiplexedConnection) {
    let prefix = batchfleet_testkit::services::unique(stem);
    let store = crate::store_at(&prefix).await;
    let raw = ::redis::Client::open("redis://127.0.0.1:6379/")
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    (store, prefix, raw)
}

/// The histogram is one running field per committing worker, written once
/// per group whatever the output's width; fields of the earlier kind (one
/// `<column>:<bin>` count each, from workers before it) read back summed
/// with them, so a job committed across an upgrade keeps its histogram.
#[tokio::test]
async fn a_histogram_is_a_field_per_worker_and_reads_back_older_bin_fields() {
    let (store, prefix, mut raw) = redis_with_raw("bftest-hist").await;
    store.put_job(&record("h")).await.expect("put");
    let key = batchfleet_shared::store::redis::job_scoped(&prefix, "h", ":hist");
    // An older worker's commit: one field per filled bin.
    let _: () = ::redis::pipe()
        .hincr(&key, "0:1", 5)
        .hincr(&key, "1:0", 2)
        .query_async(&mut raw)
        .await
        .expect("old fields");
    let (a, b, c) = (stats(0, "w1"), stats(1, "w1"), stats(2, "w2"));
    let commit = |stats, histogram| Commit {
        stats,
        histogram,
        leased: false,
    };
    let h1 = [vec![1, 2, 0], vec![0, 0, 3]];
    let h2 = [vec![0, 1, 1], vec![4, 0, 0]];
    store
        .commit_group("h", &[commit(&a, &h1), commit(&b, &h2)], Work::default())
        .await
        .expect("group");
    store
        .commit_group("h", &[commit(&c, &h1)], Work::default())
        .await
        .expect("group");
    let fields: std::collections::BTreeMap<String, String> = ::redis::cmd("HGETALL")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .expect("fields");
    assert_eq!(
        fields.keys().map(String::as_str).collect::<Vec<_>>(),
        ["0:1", "1:0", "w1", "w2"],
        "one field per committing worker beside the older ones"
    );
    assert_eq!(
        fields["w1"], "[[1,3,1],[4,0,3]]",
        "the group's two items summed"
    );
    assert_eq!(
        store.histogram("h", 3).await.expect("histogram"),
        vec![vec![2, 10, 1], vec![6, 0, 6]]
    );
    store.delete_job("h").await.expect("cleanup");
}

/// A job's done set is a bitmap — one bit per item, whatever the job's
/// size — and a job from before it (its record without `done_bits`) keeps
/// its set of seqs: every step (commit, start, lease, failure, the reads)
/// looks where the job's record says.
#[tokio::test]
async fn a_done_set_is_a_bitmap_and_an_older_job_keeps_its_set() {
    let (store, prefix, mut raw) = redis_with_raw("bftest-bits").await;
    let key = |id: &str, part: &str| batchfleet_shared::store::redis::job_scoped(&prefix, id, part);
    for (id, bits) in [("new", true), ("old", false)] {
        let mut r = record(id);
        r.items_total = 10_000;
        r.done_bits = bits;
        store.put_job(&r).await.expect("put");
        let stats: Vec<ItemStats> = (0..10_000).map(|i| stats(i, "w")).collect();
        for chunk in stats.chunks(64) {
            let commits: Vec<Commit<'_>> = chunk
                .iter()
                .map(|stats| Commit {
                    stats,
                    histogram: &[],
                    leased: false,
                })
                .collect();
            let won = store
                .commit_group(id, &commits, Work::default())
                .await
                .expect("commit");
            assert!(won.iter().all(|w| *w), "{id}");
        }
        // Committed once only, whichever the format.
        let again = [Commit {
            stats: &stats[17],
            histogram: &[],
            leased: false,
        }];
        assert_eq!(
            store
                .commit_group(id, &again, Work::default())
                .await
                .expect("again"),
            vec![false],
            "{id}"
        );
        let (set_len, bitmap_len): (u64, u64) = ::redis::pipe()
            .scard(key(id, ":done"))
            .strlen(key(id, ":donebits"))
            .query_async(&mut raw)
            .await
            .expect("sizes");
        if bits {
            assert_eq!(
                (set_len, bitmap_len),
                (0, 1_250),
                "one bit per item, nothing in a set"
            );
        } else {
            assert_eq!((set_len, bitmap_len), (10_000, 0), "the older job's set");
        }
        assert_eq!(store.done_items(id).await.expect("done").len(), 10_000);
        assert!(store.is_done(id, 9_999).await.expect("done"));
        assert_eq!(
            store.done_among(id, &[5, 10_000]).await.expect("among"),
            [5].into_iter().collect()
        );
        assert_eq!(
            store
                .start_item(id, &lease(42, "w"), &claim())
                .await
                .expect("start"),
            Start::Done,
            "{id}"
        );
        assert!(
            !store.heartbeat(id, &lease(42, "w"), 0).await.expect("beat"),
            "{id}"
        );
        let failure = ItemFailure {
            seq: 42,
            class: "model".into(),
            reason: "late".into(),
            worker: "w".into(),
            attempt: 1,
            at_ms: 1,
        };
        assert!(!store.fail_item(id, &failure).await.expect("fail"), "{id}");
        store.delete_job(id).await.expect("cleanup");
    }
}

/// Waits until the store's clock is past `ms` (a lease's staleness is a
/// time on that clock, not an event to await).
async fn store_clock_past(store: &Store, ms: u64) {
    while store.now_ms().await.expect("time") <= ms {
        tokio::task::yield_now().await;
    }
}

/// A lease is written once; its worker's beat on the job keeps it live (for
/// the supervisor's read and a worker's start alike), and only its own
/// holder's beat does: once the beats stop, it goes stale and its crash is
/// counted. A beat may also say that its worker holds deliveries of the job
/// waiting to start, for the coordinator's lost-message check.
async fn a_lease_written_once_lives_while_its_holder_beats(store: Store) {
    use batchfleet_shared::store::{boot_id, holder};
    store.put_job(&record("b")).await.expect("put");
    let returned = Claim {
        returned: true,
        ..claim()
    };
    let mut started = Vec::new();
    // Item 0 held by w1 in this process; item 1 by w1 in another process.
    for (seq, boot) in [(0, boot_id()), (1, "an-earlier-process".to_owned())] {
        let l = batchfleet_shared::store::Lease {
            ttl_ms: 1_000,
            boot,
            ..lease(seq, "w1")
        };
        let Start::Started { at_ms, crashes: 0 } =
            store.start_item("b", &l, &claim()).await.expect("start")
        else {
            panic!("not started")
        };
        started.push(at_ms);
    }
    store_clock_past(&store, started[1] + 1_001).await;
    // The beat sets the holder's field and, here, its queued field (it
    // holds deliveries of the job waiting to start), in one write.
    let me = holder("w1", &boot_id());
    let fields = [me.clone(), batchfleet_shared::store::queued_field(&me)];
    store.beat("b", &fields).await.expect("beat");
    let now = store.now_ms().await.expect("time");
    let beats = store.beats("b").await.expect("beats");
    assert_eq!(
        beats.keys().collect::<Vec<_>>(),
        [&fields[0], &fields[1]],
        "{beats:?}"
    );
    assert!(
        beats.values().all(|at| *at > started[1] && *at <= now),
        "stamped with the store's clock: {beats:?}"
    );
    // Several jobs' beats at once (one request on one server): each job
    // gets its own fields, and a job with none is left alone.
    let others = [
        ("b-other".to_owned(), vec![me.clone()]),
        ("b-none".to_owned(), Vec::new()),
        (
            "b-queued".to_owned(),
            vec![batchfleet_shared::store::queued_field(&me)],
        ),
    ];
    store.beat_jobs(&others).await.expect("beats");
    for (job, want) in &others {
        let beats = store.beats(job).await.expect("beats");
        assert_eq!(
            beats.keys().collect::<Vec<_>>(),
            want.iter().collect::<Vec<_>>(),
            "{job}"
        );
        assert!(
            beats.values().all(|at| *at >= now),
            "stamped with the store's clock: {beats:?}"
        );
    }
    let leases = store.leases("b").await.expect("leases");
    let live: Vec<u32> = leases
        .iter()
        .filter(|l| !l.is_stale(now))
        .map(|l| l.seq)
        .collect();
    assert_eq!(
        live,
        [0],
        "only the beating holder's lease is live: {leases:?}"
    );
    // A returned delivery of item 0 waits for the live holder; item 1's
    // holder stopped beating: its crash is counted and the item starts.
    let next = |seq| batchfleet_shared::store::Lease {
        ttl_ms: 60_000,
        ..lease(seq, "w2")
    };
    let zero = store
        .start_item("b", &next(0), &returned)
        .await
        .expect("start");
    assert!(
        matches!(zero, Start::Held { .. }),
        "a beaten lease: {zero:?}"
    );
    let one = store
        .start_item("b", &next(1), &returned)
        .await
        .expect("start");
    assert!(
        matches!(one, Start::Started { crashes: 1, .. }),
        "an unbeaten lease: {one:?}"
    );
    // Once w1 stops beating, item 0's lease goes stale as well.
    store_clock_past(&store, now + 1_001).await;
    let zero = store
        .start_item("b", &next(0), &returned)
        .await
        .expect("start");
    assert!(
        matches!(zero, Start::Started { crashes: 1, .. }),
        "beats stopped: {zero:?}"
    );
    store.delete_job("b").await.expect("cleanup");
}

/// A lease its worker marked `stopping` (draining after SIGTERM) that goes
/// stale is dropped without counting a crash, by a worker's start and by
/// the supervisor's count alike; an unmarked one beside it is counted.
async fn a_worker_stopped_while_draining_is_no_crash_of_its_items(store: Store) {
    store.put_job(&record("s")).await.expect("put");
    let returned = Claim {
        returned: true,
        ..claim()
    };
    let mut last = 0;
    for (seq, stopping) in [(0, true), (1, true), (2, false)] {
        let l = batchfleet_shared::store::Lease {
            ttl_ms: 0,
            ..lease(seq, "w1")
        };
        let Start::Started { at_ms, .. } =
            store.start_item("s", &l, &claim()).await.expect("start")
        else {
            panic!("not started")
        };
        let marked = batchfleet_shared::store::Lease {
            stopping,
            started_ms: at_ms,
            ..l
        };
        assert!(store.heartbeat("s", &marked, 0).await.expect("heartbeat"));
        last = last.max(store.now_ms().await.expect("time"));
    }
    store_clock_past(&store, last + 1).await;
    let next = batchfleet_shared::store::Lease {
        ttl_ms: 60_000,
        ..lease(0, "w2")
    };
    let started = store
        .start_item("s", &next, &returned)
        .await
        .expect("start");
    assert!(
        matches!(started, Start::Started { crashes: 0, .. }),
        "a stopping worker's stale lease: {started:?}"
    );
    let counted = store
        .count_crashes("s", &["1@w1".to_owned(), "2@w1".to_owned()])
        .await
        .expect("count");
    assert_eq!((counted[&1], counted[&2]), (0, 1), "{counted:?}");
    let left: Vec<u32> = store
        .leases("s")
        .await
        .expect("leases")
        .iter()
        .map(|l| l.seq)
        .collect();
    assert_eq!(left, [0], "the stale leases are dropped: {left:?}");
}

async fn workers_dying_on_an_item_are_counted_once_each_until_it_is_given_up(store: Store) {
    store.put_job(&record("c")).await.expect("put");
    let returned = Claim {
        returned: true,
        ..claim()
    };
    let start = |seq: u32, worker: &'static str, ttl_ms: u64, c: Claim<'static>| {
        let store = store.clone();
        async move {
            let l = batchfleet_shared::store::Lease {
                ttl_ms,
                ..lease(seq, worker)
            };
            store.start_item("c", &l, &c).await.expect("start")
        }
    };
    // w1 holds item 0 with a live lease: a returned delivery waits for it
    // (w1 may have died a moment ago), a copy that was not returned does not.
    assert!(matches!(
        start(0, "w1", 60_000, claim()).await,
        Start::Started { crashes: 0, .. }
    ));
    match start(0, "w2", 60_000, returned).await {
        Start::Held { wait_ms } => assert!((1..=60_001).contains(&wait_ms), "{wait_ms}"),
        other => panic!("a returned delivery beside a live lease: {other:?}"),
    }
    store.release("c", &lease(0, "w1")).await.expect("release");
    // w2 starts it; its lease lives 0 ms, so once the clock moves on w2
    // "died" holding it: the next start counts that crash, once.
    let Start::Started { at_ms, crashes: 0 } = start(0, "w2", 0, returned).await else {
        panic!("not started")
    };
    store_clock_past(&store, at_ms + 1).await;
    let Start::Started { at_ms, crashes: 1 } = start(0, "w3", 0, returned).await else {
        panic!("w2's stale lease is one crash")
    };
    store_clock_past(&store, at_ms + 1).await;
    // The second crash reaches max_crashes (2): given up, naming w3.
    match start(0, "w4", 60_000, returned).await {
        Start::Crashed {
            crashes: 2,
            workers,
        } => assert_eq!(workers, ["w3"]),
        other => panic!("two crashes: {other:?}"),
    }
    assert!(store.leases("c").await.expect("leases").is_empty());
    // The supervisor's count: a stale lease dropped twice counts once.
    let Start::Started { at_ms, .. } = start(1, "w1", 0, claim()).await else {
        panic!("not started")
    };
    store_clock_past(&store, at_ms + 1).await;
    let field = vec!["1@w1".to_owned()];
    let first = store.count_crashes("c", &field).await.expect("count");
    let again = store.count_crashes("c", &field).await.expect("count");
    assert_eq!((first[&1], again[&1]), (1, 1));
    // A replay forgets the item's failure and its crashes.
    store.clear_failure("c", 0).await.expect("clear");
    assert!(matches!(
        start(0, "w5", 60_000, returned).await,
        Start::Started { crashes: 0, .. }
    ));
    // max_crashes 0: crashes are counted, the item is never given up.
    store
        .put_job(&JobRecord {
            max_crashes: 0,
            ..record("c0")
        })
        .await
        .expect("put");
    for w in ["a", "b", "c"] {
        let l = batchfleet_shared::store::Lease {
            ttl_ms: 0,
            ..lease(0, w)
        };
        let Start::Started { at_ms, .. } =
            store.start_item("c0", &l, &returned).await.expect("start")
        else {
            panic!("max_crashes 0 gives nothing up")
        };
        store_clock_past(&store, at_ms + 1).await;
    }
    // The same worker id: its own process's lease is no crash, one that a
    // restarted process of that id finds (another boot) is.
    let boot = |boot: &str| batchfleet_shared::store::Lease {
        ttl_ms: 0,
        boot: boot.to_owned(),
        ..lease(0, "c")
    };
    let started = store
        .start_item("c0", &boot("1"), &returned)
        .await
        .expect("start");
    assert!(
        matches!(started, Start::Started { crashes: 3, .. }),
        "{started:?}"
    );
    let Start::Started { at_ms, .. } = started else {
        unreachable!()
    };
    store_clock_past(&store, at_ms + 1).await;
    let started = store
        .start_item("c0", &boot("1"), &returned)
        .await
        .expect("start");
    let Start::Started {
        at_ms, crashes: 3, ..
    } = started
    else {
        panic!("its own lease: {started:?}")
    };
    // Past the time that start wrote (its lease lives 0 ms).
    store_clock_past(&store, at_ms + 1).await;
    let started = store
        .start_item("c0", &boot("2"), &returned)
        .await
        .expect("start");
    assert!(
        matches!(started, Start::Started { crashes: 4, .. }),
        "a restarted process's: {started:?}"
    );
    store.delete_job("c").await.expect("cleanup");
    store.delete_job("c0").await.expect("cleanup");
}

/// Issue: at the reduce step a job's stats were read with one `HGETALL`,
/// which for 10⁵–10⁶ items outlasts the Redis client's response timeout
/// (500 ms), so such a job could not be reduced. Here 400,000 items' stats
/// (about 60 MB) and as many seqs of an older job's done set are read back
/// whole, a page at a time, by a store whose every answer must come within
/// that same half second.
#[tokio::test]
async fn the_reads_of_a_job_of_400k_items_stay_within_the_client_timeouts() {
    use ::redis::AsyncCommands;
    let (_, prefix, mut raw) = redis_with_raw("bftest-paged").await;
    let store = batchfleet_shared::store::Store::connect(
        &batchfleet_shared::endpoint::Endpoint::redis(batchfleet_shared::secret::SecretUrl::new(
            "redis://127.0.0.1:6379/",
        )),
        &prefix,
        std::time::Duration::from_millis(500),
    )
    .await
    .expect("redis");
    let job = "big";
    let stats_key = format!("{prefix}:job:{{{job}}}:stats");
    let done_key = format!("{prefix}:job:{{{job}}}:done");
    const N: u32 = 400_000;
    for chunk in (0..N).collect::<Vec<_>>().chunks(10_000) {
        let mut fields = Vec::with_capacity(chunk.len());
        for &seq in chunk {
            let s = ItemStats {
                worker: format!("worker-with-a-longish-name-{}", seq % 7),
                ..stats(seq, "w")
            };
            fields.push((seq, serde_json::to_string(&s).expect("json")));
        }
        let _: () = raw.hset_multiple(&stats_key, &fields).await.expect("HSET");
        let _: () = raw.sadd(&done_key, chunk).await.expect("SADD");
    }
    let all = store.item_stats(job).await.expect("every item's stats");
    assert_eq!(all.len(), N as usize);
    assert!(
        all.windows(2).all(|w| w[0].seq + 1 == w[1].seq),
        "in seq order, each once"
    );
    let done = store.done_items(job).await.expect("the done set");
    assert_eq!(done.len(), N as usize);
    // UNLINK: freed in the background, so a loaded host does not make the
    // cleanup of 400k fields outlast the 500 ms client timeout.
    let _: () = raw.unlink(&[&stats_key, &done_key]).await.expect("cleanup");
}

/// A Redis that answers a write only after more than half a second (here it
/// holds every client's writes for 1.5 s with `CLIENT PAUSE`, as a host too
/// busy to run it, or a long script, would) is waited for, up to the
/// process's connect timeout: with the client's own default of 500 ms such
/// a write failed as "timed out", and on a busy host a coordinator's job
/// start with it.
#[tokio::test]
async fn a_slow_answer_is_waited_for_not_taken_for_an_outage() {
    let store = crate::store("bftest-slow").await;
    store
        .put_job(&JobRecord::sample("j"))
        .await
        .expect("a first write, on a connection of its own");
    let paused = batchfleet_testkit::services::redis_cli(&["client", "pause", "1500", "write"])
        .expect("redis-cli");
    assert_eq!(paused, "OK");
    let asked = std::time::Instant::now();
    store
        .update_job("j", &RecordUpdate::Priority("high".into()))
        .await
        .expect("answered once the pause ends");
    assert!(
        asked.elapsed() >= std::time::Duration::from_millis(1_000),
        "the write waited for the pause: {:?}",
        asked.elapsed()
    );
    let job = store.job("j").await.expect("read").expect("the job");
    assert_eq!(job.priority, "high");
    store.delete_job("j").await.expect("cleanup");
}

async fn a_job_s_deadline_and_pace_are_kept_in_its_record(store: Store) {
    let id = "paced-00000001";
    store.put_job(&record(id)).await.expect("put");
    assert_eq!(store.job_pace(id).await.expect("pace"), None);
    store
        .update_job(
            id,
            &RecordUpdate::Deadline {
                deadline_ms: 9_000,
                worker_hour_cost: Some(1.5),
            },
        )
        .await
        .expect("deadline");
    let pace = Pace {
        at_ms: 5,
        workers: 3,
        rows_per_worker_s: Some(2.5),
        workers_needed: Some(7),
        finish_ms: Some(12_000),
        late: true,
        worker_s: 40.0,
        worker_s_to_go: Some(80.0),
    };
    store
        .update_job(id, &RecordUpdate::Pace(pace.clone()))
        .await
        .expect("pace");
    // The pace alone, in one read, and the whole record, agree.
    assert_eq!(store.job_pace(id).await.expect("pace"), Some(pace.clone()));
    let job = store.job(id).await.expect("job").expect("a record");
    assert_eq!(
        (job.deadline_ms, job.worker_hour_cost, job.pace),
        (9_000, Some(1.5), Some(pace))
    );
    assert_eq!(
        store.job_pace("no-such-00000000").await.expect("pace"),
        None
    );
    store.delete_job(id).await.expect("cleanup");
}
