//! A new job's queue is consumed as soon as the job is announced: with the
//! workers' timer that looks at the pool's active jobs set to an hour, only
//! the announcement on the pool's notice exchange can bring them to it.

use crate::support::{Backend, TestEnv};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::verify::verify;

crate::on_both_backends!(a_new_job_is_consumed_as_soon_as_it_is_announced);

async fn a_new_job_is_consumed_as_soon_as_it_is_announced(backend: Backend) {
    let env = TestEnv::new("starts");
    // Two jobs one after the other on the same workers (fleet: already
    // consuming, their one look at the active jobs made before either
    // existed; local: pipelines of each run).
    let mut workers = env.workers(backend, &[&["--debug-jobs-every", "1h"]]).await;
    let mut ids = Vec::new();
    for name in ["first", "second"] {
        let dir = env.path().join(name);
        let gen = JobGen {
            rows: 300,
            files: 1,
            features: 4,
            hidden: 8,
            name: batchfleet_testkit::services::unique(name),
            pool: env.pool.clone(),
            item_rows: 100,
            batch_size: 64,
            ..JobGen::default()
        };
        make_job(&dir, &gen).expect("generate job");
        let (job_id, report) = env.run_on(&workers, &dir.join("job.toml")).await;
        assert_eq!(report.status, "completed", "{name}");
        let v = verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5).expect("verify");
        assert!(v.ok(), "{name}: {}", v.describe());
        assert_eq!(v.output_rows, 300, "{name}");
        ids.push(job_id);
    }
    workers.stop();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.cleanup(&ids).await;
}
