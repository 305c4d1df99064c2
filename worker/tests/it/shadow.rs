//! Shadow scoring (`[model.shadow]`) against the real RabbitMQ, Redis and
//! libtorch: a candidate whose difference from the job's model is known
//! runs beside it on every mini-batch; the output stays the job's model's,
//! the shadow's values land in `<name>_shadow` columns, and the summary's
//! `shadow` section gives the figures PyTorch computes from the two models.
//! A shadow that raises on some rows costs the comparison those rows, never
//! the job.

use crate::support::{Backend, TestEnv};
use batchfleet_testkit::python::{make_job, make_shadow_models, JobGen};
use batchfleet_testkit::verify::verify;

crate::on_both_backends!(
    a_shadow_model_is_compared_over_every_row_with_the_figures_pytorch_gives,
    a_shadow_model_that_raises_costs_the_comparison_its_rows_not_the_job
);

/// A 3-output job of 3,000 rows in items of 500, and its shadow models.
fn shadow_job(env: &TestEnv) -> std::path::PathBuf {
    let dir = env.path().to_owned();
    let gen = JobGen {
        rows: 3_000,
        files: 2,
        outputs: 3,
        name: batchfleet_testkit::services::unique("shadow"),
        pool: env.pool.clone(),
        item_rows: 500,
        batch_size: 128,
        ..JobGen::default()
    };
    make_job(&dir, &gen).expect("generate job");
    make_shadow_models(&dir).expect("shadow models");
    dir.join("job.toml")
}

fn close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
        "{what}: {got} against PyTorch's {want}"
    );
}

async fn a_shadow_model_is_compared_over_every_row_with_the_figures_pytorch_gives(
    backend: Backend,
) {
    let env = TestEnv::new("shadow");
    let manifest = shadow_job(&env);
    let candidate = env.path().join("candidate.pt");
    let mut cfg = env.run_config();
    cfg.overrides = vec![
        format!("model.shadow.path=\"{}\"", candidate.display()),
        "output.shadow=\"columns\"".into(),
        "output.argmax=true".into(),
    ];
    let mut workers = env.workers(backend, &[&[], &[]]).await;
    let (id, report) = env.run_on_with(&workers, &manifest, &cfg).await;
    workers.stop();
    assert_eq!(report.status, "completed", "{report:?}");
    let out = env.path().join("out");
    // The job's own output is the job's model's, every row once.
    let main = verify(&out, &env.path().join("golden.csv"), 1e-5).expect("verify");
    assert!(
        main.ok() && main.output_rows == 3_000,
        "{}",
        main.describe()
    );
    // The shadow columns hold the candidate's outputs.
    let shadow = verify(&out, &env.path().join("shadow_golden.csv"), 1e-5).expect("verify");
    assert!(shadow.ok(), "{}", shadow.describe());
    // The job's histogram counts the job's model only.
    let predictions = report.predictions.as_ref().expect("histogram");
    assert_eq!(
        predictions
            .columns
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>(),
        ["score_0", "score_1", "score_2"]
    );

    let expected: serde_json::Value = serde_json::from_slice(
        &std::fs::read(env.path().join("shadow_expected.json")).expect("expected"),
    )
    .expect("json");
    let s = report.shadow.as_ref().expect("a shadow section");
    assert_eq!(s.model, candidate.display().to_string());
    assert_eq!(s.rows_compared, 3_000, "{s:?}");
    assert_eq!(s.rows_not_compared, 0, "{s:?}");
    assert!(s.error.is_none(), "{s:?}");
    for (got, want) in s
        .columns
        .iter()
        .zip(expected["columns"].as_array().expect("columns"))
    {
        assert_eq!(got.name, want["name"].as_str().expect("name"));
        for (field, value) in [
            ("max_abs_diff", got.max_abs_diff),
            ("mean_abs_diff", got.mean_abs_diff),
            ("pearson", got.pearson.expect("pearson")),
            ("mean_main", got.mean_main),
            ("mean_shadow", got.mean_shadow),
        ] {
            close(
                value,
                want[field].as_f64().expect("figure"),
                &format!("{} {field}", got.name),
            );
        }
    }
    // The candidate differs from the job's model: every figure says so.
    assert!(s.columns.iter().all(|c| c.max_abs_diff > 1e-3), "{s:?}");
    let agreement = s.agreement.as_ref().expect("argmax: agreement");
    assert_eq!(agreement.rows, expected["agree"].as_u64().expect("agree"));
    assert!(
        agreement.rows < 3_000,
        "the models disagree on some rows: {agreement:?}"
    );
    let confusion: Vec<Vec<u64>> =
        serde_json::from_value(expected["confusion"].clone()).expect("confusion");
    assert_eq!(
        agreement.confusion.as_ref().expect("table").counts,
        confusion
    );
    // Both histograms over the same rows, and the time each model took.
    let (a, b) = (
        s.main_distribution.as_ref().expect("main"),
        s.shadow_distribution.as_ref().expect("shadow"),
    );
    assert_eq!(a.columns[0].rows, 3_000);
    assert_eq!(b.columns[0].rows, 3_000);
    assert!(s.columns.iter().all(|c| c.psi.is_some() && c.ks.is_some()));
    assert!(s.forward_us_per_row.main > 0.0 && s.forward_us_per_row.shadow > 0.0);
    env.cleanup(&[&id]).await;
}

async fn a_shadow_model_that_raises_costs_the_comparison_its_rows_not_the_job(backend: Backend) {
    let env = TestEnv::new("shadow-raises");
    let manifest = shadow_job(&env);
    let mut cfg = env.run_config();
    cfg.overrides = vec![format!(
        "model.shadow.path=\"{}\"",
        env.path().join("raising.pt").display()
    )];
    let mut workers = env.workers(backend, &[&[]]).await;
    let (id, report) = env.run_on_with(&workers, &manifest, &cfg).await;
    workers.stop();
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!((report.rows_predicted, report.rows_rejected), (3_000, 0));
    let main = verify(
        &env.path().join("out"),
        &env.path().join("golden.csv"),
        1e-5,
    )
    .expect("verify");
    assert!(
        main.ok() && main.output_rows == 3_000,
        "{}",
        main.describe()
    );
    let expected: serde_json::Value = serde_json::from_slice(
        &std::fs::read(env.path().join("shadow_expected.json")).expect("expected"),
    )
    .expect("json");
    let raising = expected["raising_rows"].as_u64().expect("raising rows");
    assert!(raising > 0);
    let s = report.shadow.as_ref().expect("a shadow section");
    assert_eq!(s.rows_not_compared, raising, "{s:?}");
    assert_eq!(s.rows_compared, 3_000 - raising, "{s:?}");
    assert!(
        s.error.as_deref().is_some_and(|e| e.contains("raised")),
        "{s:?}"
    );
    // The rows it did predict are the base model's own: no difference.
    assert!(s.columns.iter().all(|c| c.max_abs_diff < 1e-5), "{s:?}");
    env.cleanup(&[&id]).await;
}
