//! Planning time by file count and by file size, cut blind (the default for
//! CSV and JSON Lines: sizes only) against cut by reading every record
//! (`[input] quoted_newlines = true`, the planning of earlier versions), on
//! local files and on the local S3 server.
//!
//! Each figure is the wall time of validating the manifest and planning the
//! job (what `batchfleet run` does before it publishes), median of three.

use anyhow::{Context, Result};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Sizes of the planning measurement.
#[derive(Debug, Clone, Copy)]
pub struct PlanningConfig {
    /// Small files of the many-files job.
    pub files: usize,
    /// Bytes of the one-big-file job.
    pub big_bytes: u64,
    /// Files and bytes of the same two jobs in S3 (moto holds objects in memory).
    pub s3_files: usize,
    /// Bytes of the big S3 object.
    pub s3_big_bytes: u64,
    /// Also plan by reading every record (false: the blind cut alone).
    pub read: bool,
}

/// Bytes of each file of the many-files job: about ten rows.
const SMALL_FILE_BYTES: u64 = 3_000;

/// One planning figure.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PlanTime {
    /// `local` or `s3`.
    pub place: String,
    /// Input files.
    pub files: usize,
    /// Input bytes.
    pub bytes: u64,
    /// Items planned cut blind.
    pub items_blind: usize,
    /// Seconds to validate and plan, cut blind (median of 3).
    pub blind_s: f64,
    /// Items planned by reading.
    pub items_read: usize,
    /// Seconds to validate and plan by reading every record (median of 3;
    /// 0 when not measured).
    pub read_s: f64,
    /// S3: seconds the bare listing of the objects takes (median of 3),
    /// part of every figure above: what the object store costs, not the planner.
    pub list_s: f64,
}

/// 32 features, like the bench's small model.
fn header() -> String {
    let mut h = "id".to_owned();
    for i in 0..32 {
        h.push_str(&format!(",f{i}"));
    }
    h + "\n"
}

/// About `bytes` of CSV rows (the header, then rows of 32 six-decimal
/// features): one block of rows of up to a MiB, written as often as needed
/// (planning reads no ids, so repeats do not matter).
fn write_csv(path: &Path, bytes: u64, first_row: u64) -> Result<()> {
    let mut block = String::with_capacity((1 << 20) + 512);
    let mut row = first_row;
    while (block.len() as u64) < bytes.min(1 << 20) {
        block.push_str(&format!("r{row:010}"));
        for j in 0..32u64 {
            let v = ((row * 31 + j * 17) % 4000) as f64 / 1000.0 - 2.0;
            block.push_str(&format!(",{v:.6}"));
        }
        block.push('\n');
        row += 1;
    }
    let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
    f.write_all(header().as_bytes())?;
    let mut written = 0u64;
    while written < bytes {
        f.write_all(block.as_bytes())?;
        written += block.len() as u64;
    }
    f.flush()?;
    Ok(())
}

/// `files` CSV files of about `each` bytes in `data`; their total bytes.
fn write_files(data: &Path, files: usize, each: u64) -> Result<u64> {
    let mut bytes = 0;
    for f in 0..files {
        let p = data.join(format!("part-{f:05}.csv"));
        write_csv(&p, each.max(1), (f as u64) * 10)?;
        bytes += std::fs::metadata(&p)?.len();
    }
    Ok(bytes)
}

fn manifest(dir: &Path, paths: &str, read: bool) -> Result<PathBuf> {
    let m = dir.join(if read { "read.toml" } else { "blind.toml" });
    let quoted = if read { "quoted_newlines = true\n" } else { "" };
    std::fs::write(
        &m,
        format!(
            "[job]\nname = \"planning\"\n[input]\nformat = \"csv\"\npaths = [\"{paths}\"]\nid_column = \"id\"\nfeature_columns = [\"f0..f31\"]\n{quoted}[model]\npath = \"model.pt\"\n[batching]\nitem_rows = 20000\n[output]\ndir = \"out\"\n"
        ),
    )?;
    Ok(m)
}

/// Median seconds of three validations + plans of `manifest`, and its items.
fn time_plan(manifest: &Path, roots: &[PathBuf]) -> Result<(f64, usize)> {
    let mut times = Vec::new();
    let mut items = 0;
    for _ in 0..3 {
        let t = Instant::now();
        let spec = batchfleet_coordinator::manifest::load(manifest, roots)?;
        let plan = batchfleet_coordinator::planner::plan(&spec)
            .with_context(|| format!("planning {}", manifest.display()))?;
        times.push(t.elapsed().as_secs_f64());
        items = plan.items.len();
    }
    times.sort_by(f64::total_cmp);
    Ok((times[1], items))
}

fn measure(
    place: &str,
    dir: &Path,
    paths: &str,
    files: usize,
    bytes: u64,
    roots: &[PathBuf],
    read: bool,
) -> Result<PlanTime> {
    let (blind_s, items_blind) = time_plan(&manifest(dir, paths, false)?, roots)?;
    let (read_s, items_read) = if read {
        time_plan(&manifest(dir, paths, true)?, roots)?
    } else {
        (0.0, 0)
    };
    let list_s = if batchfleet_shared::source::is_url(Path::new(paths)) {
        let mut times = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            batchfleet_shared::source::glob(paths)?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        times[1]
    } else {
        0.0
    };
    let t = PlanTime {
        place: place.into(),
        files,
        bytes,
        items_blind,
        blind_s,
        items_read,
        read_s,
        list_s,
    };
    let listing = if place == "s3" {
        format!("; the listing alone {:.3} s", t.list_s)
    } else {
        String::new()
    };
    println!(
        "bench [planning] {place}: {files} files, {:.1} MB: cut blind {:.3} s ({} items), by reading {:.3} s ({} items){listing}",
        bytes as f64 / 1e6,
        t.blind_s,
        t.items_blind,
        t.read_s,
        t.items_read
    );
    Ok(t)
}

/// Writes the inputs under `root` and measures planning on them, locally
/// and (when `s3_files` > 0) on a local S3 server.
pub fn run(cfg: PlanningConfig, root: &Path) -> Result<Vec<PlanTime>> {
    let mut out = Vec::new();
    let model = batchfleet_shared::model_file::torchscript_like_zip();
    for (name, files, each) in [
        ("many", cfg.files, SMALL_FILE_BYTES),
        ("big", 1, cfg.big_bytes),
    ] {
        let dir = root.join(format!("planning-{name}"));
        std::fs::create_dir_all(dir.join("data"))?;
        std::fs::write(dir.join("model.pt"), &model)?;
        println!("bench [planning] writing {files} file(s)…");
        let bytes = write_files(&dir.join("data"), files, each)?;
        out.push(measure(
            "local",
            &dir,
            "data/*.csv",
            files,
            bytes,
            &[],
            cfg.read,
        )?);
        if cfg.s3_files == 0 {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    if cfg.s3_files > 0 {
        out.extend(on_s3(cfg, root, &model)?);
    }
    for name in ["many", "big"] {
        let _ = std::fs::remove_dir_all(root.join(format!("planning-{name}")));
    }
    Ok(out)
}

fn on_s3(cfg: PlanningConfig, root: &Path, model: &[u8]) -> Result<Vec<PlanTime>> {
    let s3 = batchfleet_testkit::services::S3Server::start()?;
    s3.configure_this_process();
    let mut out = Vec::new();
    for (name, files, each) in [
        ("many", cfg.s3_files, SMALL_FILE_BYTES),
        ("big", 1, cfg.s3_big_bytes),
    ] {
        let dir = root.join(format!("planning-s3-{name}"));
        let data = dir.join("data");
        std::fs::create_dir_all(&data)?;
        std::fs::write(dir.join("model.pt"), model)?;
        let bytes = write_files(&data, files, each)?;
        println!("bench [planning] uploading {files} file(s) to the local S3 server…");
        let prefix = batchfleet_testkit::services::unique(name);
        s3.put_dir("batchfleet-bench", &prefix, &data)?;
        let url = format!("s3://batchfleet-bench/{prefix}");
        let roots = [dir.clone(), PathBuf::from(&url)];
        out.push(measure(
            "s3",
            &dir,
            &format!("{url}/*.csv"),
            files,
            bytes,
            &roots,
            cfg.read,
        )?);
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}
