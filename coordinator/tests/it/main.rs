//! `batchfleet` command-line tests: bad input gets a clear error, the
//! documented exit code, and publishes nothing (against the real RabbitMQ
//! and Redis); `run --local` needs neither, and a killed job resumes on both
//! backends; `[on_complete]` hooks within the operator's policy.

mod cli;
mod hooks;
mod local_run;
mod shadow;
mod since;
