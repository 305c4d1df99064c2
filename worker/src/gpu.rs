//! GPU memory and utilisation for Prometheus, from NVML (the NVIDIA
//! Management Library, `libnvidia-ml.so`, which `nvml-wrapper` loads at run
//! time): the driver's own figures, read in microseconds, instead of
//! starting `nvidia-smi` every sample. Where the library is absent (no
//! NVIDIA driver) or finds no GPU, there are no GPU series and one log line
//! says so.

use batchfleet_shared::metrics::names;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Starts sampling every `every` on a thread of its own (NVML calls
/// block), or says once why there is nothing to sample.
pub fn start_sampler(every: Duration) {
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(nvml) => nvml,
        Err(e) => {
            tracing::info!(error = %e, "NVML is not available (no NVIDIA driver here): no GPU metrics");
            return;
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    if count == 0 {
        tracing::info!("NVML found no GPU: no GPU metrics");
        return;
    }
    tracing::info!(gpus = count, "GPU metrics from NVML");
    let spawned = std::thread::Builder::new()
        .name("gpu-metrics".into())
        .spawn(move || loop {
            sample(&nvml, count);
            std::thread::sleep(every);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the GPU metrics thread: no GPU metrics");
    }
}

/// The largest share of a GPU's memory in use at the last sample, in
/// ten-thousandths; `u32::MAX` before the first (or with no GPU).
static FULLEST: AtomicU32 = AtomicU32::new(u32::MAX);

/// The largest share of any GPU's memory in use at the last sample
/// (`inference_batch_size = "auto"` stops growing past 0.9); `None` where
/// NVML is not sampled.
pub fn used_fraction() -> Option<f64> {
    let v = FULLEST.load(Ordering::Relaxed);
    (v != u32::MAX).then(|| f64::from(v) / 10_000.0)
}

/// One reading of every GPU; a figure NVML cannot give is left out.
fn sample(nvml: &nvml_wrapper::Nvml, count: u32) {
    let mut fullest = 0f64;
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let gpu = index.to_string();
        if let Ok(memory) = device.memory_info() {
            metrics::gauge!(names::WORKER_GPU_MEMORY, "gpu" => gpu.clone()).set(memory.used as f64);
            if memory.total > 0 {
                fullest = fullest.max(memory.used as f64 / memory.total as f64);
            }
        }
        if let Ok(rates) = device.utilization_rates() {
            metrics::gauge!(names::WORKER_GPU_UTILIZATION, "gpu" => gpu)
                .set(f64::from(rates.gpu) / 100.0);
        }
    }
    FULLEST.store((fullest * 10_000.0).round() as u32, Ordering::Relaxed);
}
