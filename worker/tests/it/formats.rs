//! Model formats: one MLP as TorchScript and as an AOTInductor package
//! (`.pt2`, compiled ahead of time for the CPU by
//! `torch._inductor.aoti_compile_and_package`), run by worker processes
//! through libtorch's package loader; both give PyTorch's outputs. An
//! uncompiled `torch.export` program, and `[model] dtype` with a package,
//! are refused at validation.

use crate::support::{Backend, TestEnv};
use batchfleet_testkit::python::make_aoti_model;
use batchfleet_testkit::verify::verify;

fn manifest(env: &TestEnv, model: &str, out: &str, extra: &str) -> std::path::PathBuf {
    let text = format!(
        r#"[job]
name = "{name}"
pool = "{pool}"

[input]
format = "csv"
paths = ["input.csv"]
id_column = "id"
feature_columns = ["f0..f15"]

[model]
path = "{model}"
{extra}

[batching]
item_rows = 250
inference_batch_size = 64

[output]
dir = "{out}"
"#,
        name = batchfleet_testkit::services::unique("formats"),
        pool = env.pool,
    );
    let path = env.path().join(format!("{out}.toml"));
    std::fs::write(&path, text).expect("write manifest");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aoti_package_runs_like_the_torchscript_model() {
    let env = TestEnv::new("formats");
    make_aoti_model(env.path(), (1_000, 16, 64, 4)).expect("make the models");
    let mut workers = env.workers(Backend::Fleet, &[&[], &[]]).await;
    let mut jobs = Vec::new();
    for (model, out) in [("model.pt", "out-pt"), ("model.pt2", "out-pt2")] {
        let path = manifest(&env, model, out, "");
        let (job, summary) = env.run_on(&workers, &path).await;
        assert_eq!(summary.status, "completed", "{model}: {summary:?}");
        assert_eq!(summary.rows_predicted, 1_000, "{model}");
        let v = verify(
            &env.path().join(out),
            &env.path().join("expected.csv"),
            1e-5,
        )
        .expect("verify");
        assert!(v.ok(), "{model}: {}", v.describe());
        jobs.push(job);
    }
    let roots = [env.path().to_owned()];
    let refused = |model: &str, out: &str, extra: &str| {
        batchfleet_coordinator::manifest::load(&manifest(&env, model, out, extra), &roots)
            .expect_err("refused at validation")
            .to_string()
    };
    let err = refused("program.pt2", "out-program", "");
    assert!(
        err.contains("is a torch.export program") && err.contains("aoti_compile_and_package"),
        "{err}"
    );
    let err = refused("model.pt2", "out-bf16", "dtype = \"bfloat16\"");
    assert!(
        err.contains("[model] dtype:") && err.contains("AOTInductor package"),
        "{err}"
    );
    workers.stop();
    env.cleanup(&jobs.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
}
