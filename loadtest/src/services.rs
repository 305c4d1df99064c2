//! Makes sure the local RabbitMQ and Redis that tests and benchmarks use are
//! up, starting them with the documented commands when they are not.

use anyhow::{bail, Result};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// RabbitMQ's AMQP port on loopback.
pub const RABBITMQ: &str = "127.0.0.1:5672";
/// Redis on loopback.
pub const REDIS: &str = "127.0.0.1:6379";

fn listening(addr: &str) -> bool {
    let addr: SocketAddr = addr.parse().expect("valid socket address");
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

fn wait_for(addr: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if listening(addr) {
            return true;
        }
        // Nothing to subscribe to before the port exists: poll it.
        std::thread::sleep(Duration::from_millis(250));
    }
    listening(addr)
}

fn start(addr: &str, program: &str, args: &[&str], within: Duration) -> Result<()> {
    if listening(addr) {
        return Ok(());
    }
    eprintln!("{addr} is not listening; starting {program}");
    let status = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if let Err(e) = status {
        bail!("{addr} is down and `{program}` could not be started ({e}); install it or start it by hand");
    }
    if !wait_for(addr, within) {
        bail!(
            "{program} did not start listening on {addr} within {}s",
            within.as_secs()
        );
    }
    Ok(())
}

/// Ensures RabbitMQ (5672) and Redis (6379) listen on loopback.
pub fn ensure_local() -> Result<()> {
    start(
        REDIS,
        "redis-server",
        &[
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "-::1",
            "--port",
            "6379",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        Duration::from_secs(20),
    )?;
    start(
        RABBITMQ,
        "rabbitmq-server",
        &["-detached"],
        Duration::from_secs(90),
    )?;
    Ok(())
}

/// A name unique to this process and call, for queues, pools and key prefixes.
pub fn unique(stem: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{stem}-{}-{:x}-{}",
        std::process::id(),
        nanos,
        N.fetch_add(1, Ordering::Relaxed)
    )
}
