//! Least privilege, with the definitions the deployment files ship
//! (docker/rabbitmq/permissions.sh, docker/redis/entrypoint.sh's ACL
//! rules): a RabbitMQ user for the pool's workers whose permissions cover
//! only that pool's queues, one for the coordinator, and Redis ACL users
//! limited to the key prefix and the commands batchfleet uses (no FLUSHALL,
//! CONFIG, KEYS). A job runs with
//! them, end to end; the workers' users cannot touch another pool's queue
//! or another prefix's keys.

use crate::support::{stop_all, TestEnv};
use batchfleet_shared::broker::PoolQueues;
use batchfleet_shared::endpoint::Endpoint;
use batchfleet_shared::secret::SecretUrl;
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services::{rabbitmqctl, unique};
use std::time::Duration;

/// Lines printed by a function of docker/rabbitmq/permissions.sh, the
/// definitions the compose stack's broker applies and docs/deploy.md gives.
fn shipped_permissions(call: &str) -> [String; 3] {
    let script = batchfleet_testkit::python::repo_root().join("docker/rabbitmq/permissions.sh");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(". '{}'; {call}", script.display()))
        .output()
        .expect("sh");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    lines
        .try_into()
        .unwrap_or_else(|l| panic!("three regexes from {call}: {l:?}"))
}

/// The Redis ACL rules docker/redis/entrypoint.sh gives batchfleet's users,
/// with the test's key prefix for `bf`.
fn shipped_redis_rules(prefix: &str) -> Vec<String> {
    let script = std::fs::read_to_string(
        batchfleet_testkit::python::repo_root().join("docker/redis/entrypoint.sh"),
    )
    .expect("docker/redis/entrypoint.sh");
    let rules = script
        .lines()
        .find_map(|l| l.strip_prefix("rules='")?.strip_suffix('\''))
        .expect("a rules='…' line");
    assert!(rules.contains("~bf:*"), "{rules}");
    rules
        .replace("~bf:*", &format!("~{prefix}:*"))
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// RabbitMQ and Redis users that exist for one test, removed at the end.
struct Users {
    rabbit: Vec<String>,
    redis: Vec<String>,
}

impl Drop for Users {
    fn drop(&mut self) {
        for u in &self.rabbit {
            let _ = rabbitmqctl(&["delete_user", u]);
        }
        if let Ok(mut c) =
            redis::Client::open("redis://127.0.0.1:6379/").and_then(|c| c.get_connection())
        {
            for u in &self.redis {
                let _: redis::RedisResult<i64> =
                    redis::cmd("ACL").arg("DELUSER").arg(u).query(&mut c);
            }
        }
    }
}

fn add_rabbit_user(users: &mut Users, name: &str, password: &str, perms: &[String; 3]) {
    rabbitmqctl(&["add_user", name, password]).expect("add_user");
    users.rabbit.push(name.to_owned());
    rabbitmqctl(&[
        "set_permissions",
        "-p",
        "/",
        name,
        &perms[0],
        &perms[1],
        &perms[2],
    ])
    .expect("set_permissions");
}

fn add_redis_user(users: &mut Users, name: &str, password: &str, prefix: &str) {
    let mut c = redis::Client::open("redis://127.0.0.1:6379/")
        .and_then(|c| c.get_connection())
        .expect("redis");
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg(name)
        .arg("reset")
        .arg("on")
        .arg(format!(">{password}"));
    for rule in shipped_redis_rules(prefix) {
        cmd.arg(rule);
    }
    let _: () = cmd.query(&mut c).expect("ACL SETUSER");
    users.redis.push(name.to_owned());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_with_least_privilege_users_and_a_worker_cannot_touch_another_pool() {
    let mut env = TestEnv::new("priv");
    let admin = env.broker().await;
    let tag = unique("u").replace(['.', ':'], "-");
    let (worker, coord) = (format!("bfw-{tag}"), format!("bfc-{tag}"));
    let mut users = Users {
        rabbit: Vec::new(),
        redis: Vec::new(),
    };
    let wp = shipped_permissions(&format!("worker_permissions '{}'", env.pool));
    add_rabbit_user(&mut users, &worker, "w-pass", &wp);
    add_rabbit_user(
        &mut users,
        &coord,
        "c-pass",
        &shipped_permissions("coordinator_permissions"),
    );
    add_redis_user(&mut users, &worker, "w-pass", &env.prefix);
    add_redis_user(&mut users, &coord, "c-pass", &env.prefix);
    let endpoints = |user: &str, pass: &str| {
        (
            Endpoint::amqp(SecretUrl::new(format!(
                "amqp://{user}:{pass}@127.0.0.1:5672/%2f"
            ))),
            Endpoint::redis(SecretUrl::new(format!(
                "redis://{user}:{pass}@127.0.0.1:6379/"
            ))),
        )
    };
    // Workers (and the test's own handles) run as the worker user; the
    // coordinator as its own.
    (env.amqp, env.redis) = endpoints(&worker, "w-pass");
    let mut cfg = env.run_config();
    let (amqp, redis) = endpoints(&coord, "c-pass");
    cfg.connections.backend = batchfleet_shared::backend::Backend::Fleet {
        amqp,
        redis,
        redis_prefix: env.prefix.clone(),
    };

    let gen = JobGen {
        rows: 4_000,
        files: 2,
        features: 8,
        hidden: 16,
        outputs: 1,
        name: unique("priv"),
        pool: env.pool.clone(),
        item_rows: 500,
        batch_size: 250,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let mut workers = vec![env.spawn_worker("w1", &[]), env.spawn_worker("w2", &[])];
    env.wait_for_consumers(2, &mut workers).await;
    let (job_id, summary) = crate::support::run_with_config_to_end(
        &cfg,
        &env.path().join("job.toml"),
        Duration::from_secs(180),
    )
    .await;
    assert_eq!(summary.status, "completed");
    crate::support::matches_golden(&env, 4_000);
    stop_all(&mut workers);
    for w in &workers {
        assert!(!w.log_text().contains("ACCESS_REFUSED"), "{}", w.log_text());
    }

    // Another pool's queues exist (made by the admin user here) but the
    // worker's user can neither read, purge, delete nor declare them.
    let other = PoolQueues::new(unique("other"));
    admin.declare(&other).await.expect("declare another pool");
    let as_worker = env.broker().await;
    assert!(
        as_worker.get(&other.work()).await.is_err(),
        "read another pool's queue"
    );
    let as_worker = env.broker().await;
    assert!(
        as_worker.purge(&other.work()).await.is_err(),
        "purge another pool's queue"
    );
    let as_worker = env.broker().await;
    assert!(
        as_worker.delete(&other.dead()).await.is_err(),
        "delete another pool's queue"
    );
    let as_worker = env.broker().await;
    assert!(
        as_worker
            .declare(&PoolQueues::new(unique("new")))
            .await
            .is_err(),
        "declare a pool"
    );
    assert!(
        admin
            .ready_count(&other.dead())
            .await
            .expect("passive")
            .is_some(),
        "the other pool's dead queue is still there"
    );
    let _ = admin.delete_pool(&other).await;
    admin.close("bye").await;

    // The worker's Redis user: its prefix only, and none of the commands
    // that could wipe or reconfigure the server.
    let mut c = redis::Client::open(env.redis.url.expose())
        .and_then(|c| c.get_connection())
        .expect("redis as the worker");
    let refused = |r: redis::RedisResult<redis::Value>| {
        r.err()
            .is_some_and(|e| e.to_string().to_ascii_lowercase().contains("noperm"))
    };
    assert!(refused(
        redis::cmd("GET").arg("bf-other-prefix:job:x").query(&mut c)
    ));
    for (name, args) in [
        ("FLUSHALL", vec![]),
        ("CONFIG", vec!["GET", "maxmemory"]),
        ("KEYS", vec!["*"]),
    ] {
        assert!(
            refused(redis::cmd(name).arg(&args).query(&mut c)),
            "{name} is refused"
        );
    }
    let own: redis::RedisResult<Option<String>> = redis::cmd("GET")
        .arg(format!("{}:anything", env.prefix))
        .query(&mut c);
    assert!(own.is_ok(), "its own prefix: {own:?}");
    env.cleanup(&[&job_id]).await;
    drop(users);
}
