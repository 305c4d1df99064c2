//! `amqps://` and `rediss://`: a job completes over TLS against a RabbitMQ
//! node and a Redis server of the test's own that accept only TLS and ask
//! for a client certificate, with the CA, certificates and keys made here;
//! the URLs come from `…_URL_FILE` files as mounted secrets do. A server
//! certificate from another CA is refused with an error that says what to set.

use crate::support::{stop_all, TestEnv};
use batchfleet_shared::broker::BrokerError;
use batchfleet_shared::endpoint::{Endpoint, TlsFiles};
use batchfleet_shared::secret::SecretUrl;
use batchfleet_shared::store::{Store, StoreError};
use batchfleet_testkit::nodes::{RabbitNode, RabbitOptions, TestPki, TlsRedis};
use batchfleet_testkit::python::{make_job, JobGen};
use std::path::Path;
use std::time::Duration;

/// `BATCHFLEET_<SERVICE>_{CA,CERT,KEY}_FILE` for a client of the test CA.
fn tls_env(pki: &TestPki, ca: &Path) -> Vec<(&'static str, String)> {
    let s = |p: &Path| p.display().to_string();
    vec![
        ("BATCHFLEET_AMQP_CA_FILE", s(ca)),
        ("BATCHFLEET_AMQP_CERT_FILE", s(&pki.client_cert)),
        ("BATCHFLEET_AMQP_KEY_FILE", s(&pki.client_key)),
        ("BATCHFLEET_REDIS_CA_FILE", s(ca)),
        ("BATCHFLEET_REDIS_CERT_FILE", s(&pki.client_cert)),
        ("BATCHFLEET_REDIS_KEY_FILE", s(&pki.client_key)),
    ]
}

fn client_files(pki: &TestPki, ca: &Path) -> TlsFiles {
    TlsFiles {
        ca_file: Some(ca.to_owned()),
        cert_file: Some(pki.client_cert.clone()),
        key_file: Some(pki.client_key.clone()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_completes_over_tls_and_a_server_from_another_ca_is_refused() {
    let mut env = TestEnv::new("tls");
    let pki = TestPki::make(&env.path().join("pki")).expect("test certificates");
    let redis = TlsRedis::start(env.path(), &pki).expect("TLS Redis");
    let rabbit = RabbitNode::start(
        &env.path().join("rabbit"),
        RabbitOptions {
            tls: Some(&pki),
            ..RabbitOptions::default()
        },
    )
    .expect("TLS RabbitMQ");
    // Every handle the test makes goes to the TLS servers from here on.
    env.amqp = Endpoint::amqp(SecretUrl::new(rabbit.url())).with_tls(client_files(&pki, &pki.ca));
    env.redis = Endpoint::redis(SecretUrl::new(redis.url())).with_tls(client_files(&pki, &pki.ca));

    // A server certificate the client's CA did not sign: refused, as a
    // permanent error naming the setting to fix and never the password.
    let wrong = client_files(&pki, &pki.other_ca);
    let Err(err) = batchfleet_shared::broker::connect(
        &env.amqp.clone().with_tls(wrong.clone()),
        "tls-test",
        Duration::from_secs(10),
    )
    .await
    else {
        panic!("a server certificate from another CA is refused");
    };
    assert!(
        matches!(err, BrokerError::Untrusted { .. }) && err.is_permanent(),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("BATCHFLEET_AMQP_CA_FILE") && !text.contains(":guest@"),
        "{text}"
    );
    let err = Store::connect(
        &env.redis.clone().with_tls(wrong),
        &env.prefix,
        Duration::from_secs(10),
    )
    .await
    .expect_err("a server certificate from another CA is refused");
    assert!(
        matches!(err, StoreError::Untrusted { .. }) && err.is_permanent(),
        "{err}"
    );
    assert!(
        err.to_string().contains("BATCHFLEET_REDIS_CA_FILE"),
        "{err}"
    );
    // The servers ask for a client certificate: without one, no session.
    let no_client = TlsFiles {
        ca_file: Some(pki.ca.clone()),
        ..TlsFiles::default()
    };
    assert!(
        Store::connect(
            &env.redis.clone().with_tls(no_client),
            &env.prefix,
            Duration::from_secs(10)
        )
        .await
        .is_err(),
        "the TLS Redis requires a client certificate"
    );
    // A worker given the wrong CA stops at once with that error (retrying
    // cannot help), instead of retrying for its --connect-timeout.
    let mut bad = env.spawn_worker_with_env("wrong-ca", &[], &tls_env(&pki, &pki.other_ca));
    let status = bad.terminate_when_exited(Duration::from_secs(30));
    assert_eq!(
        status.code(),
        Some(i32::from(batchfleet_worker::EXIT_CONFIG)),
        "a worker that trusts no server certificate exits, for good"
    );
    let log = bad.log_text();
    assert!(
        log.contains("did not pass the TLS handshake") && log.contains("_CA_FILE"),
        "{log}"
    );

    // The job, end to end over TLS: two workers, and `batchfleet run` with
    // its URLs read from files.
    let name = batchfleet_testkit::services::unique("tls");
    let gen = JobGen {
        rows: 6_000,
        files: 2,
        features: 8,
        hidden: 16,
        outputs: 2,
        name,
        pool: env.pool.clone(),
        item_rows: 1_000,
        batch_size: 256,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let good = tls_env(&pki, &pki.ca);
    let mut workers = vec![
        env.spawn_worker_with_env("w1", &[], &good),
        env.spawn_worker_with_env("w2", &[], &good),
    ];
    env.wait_for_consumers(2, &mut workers).await;
    let secrets = env.path().join("secrets");
    std::fs::create_dir_all(&secrets).expect("secrets dir");
    std::fs::write(secrets.join("amqp-url"), format!("{}\n", rabbit.url())).expect("url file");
    std::fs::write(secrets.join("redis-url"), format!("{}\n", redis.url())).expect("url file");
    let out = std::process::Command::new(
        Path::new(env!("CARGO_BIN_EXE_batchfleet-worker")).with_file_name("batchfleet"),
    )
    .arg("run")
    .arg(env.path().join("job.toml"))
    .args(["--redis-prefix", &env.prefix])
    .env_remove("BATCHFLEET_AMQP_URL")
    .env_remove("BATCHFLEET_REDIS_URL")
    .env("BATCHFLEET_AMQP_URL_FILE", secrets.join("amqp-url"))
    .env("BATCHFLEET_REDIS_URL_FILE", secrets.join("redis-url"))
    .envs(good.iter().map(|(k, v)| (*k, v.as_str())))
    .output()
    .expect("run batchfleet");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "batchfleet run over TLS: {stderr}");
    crate::support::matches_golden(&env, 6_000);
    stop_all(&mut workers);
    // Nothing of the TLS servers outlives the test (their queues and keys
    // go with them); the shared pool's queues were never made.
    drop(rabbit);
    drop(redis);
}
