//! The server's counters, gauges and histograms, and their Prometheus text exposition.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::runtime::backend::Backend;
use crate::server::worker::Outcome;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// A cumulative histogram over [`BUCKETS`].
#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (c, &b) in self.counts.iter_mut().zip(&BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(&BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Where the model was placed, for `/metrics`.
#[derive(Debug, Clone)]
pub struct PlacementSummary {
    pub device: String,
    pub policy: String,
    pub gpu_weights: usize,
    pub weights: usize,
    pub gpu_weight_bytes: usize,
}

#[derive(Default)]
struct Latencies {
    ttft: Histogram,
    tpot: Histogram,
    queue_wait: Histogram,
}

/// Everything `/metrics` reports, shared by the HTTP handlers and the engine thread.
#[derive(Default)]
pub struct Metrics {
    ready: AtomicBool,
    placement: OnceLock<(PlacementSummary, Option<Arc<dyn Backend>>)>,
    /// Responses by HTTP status.
    responses: Mutex<std::collections::BTreeMap<u16, u64>>,
    queue_depth: AtomicUsize,
    pub queue_capacity: AtomicUsize,
    running: AtomicUsize,
    /// Sequences that may decode together (`--parallel`).
    pub parallel: AtomicUsize,
    /// Sequences in the last decode step, and the steps and their tokens so far.
    batch_size: AtomicUsize,
    decode_steps: AtomicU64,
    decode_tokens: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    latencies: Mutex<Latencies>,
}

impl Metrics {
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn set_ready(&self, placement: PlacementSummary, gpu: Option<Arc<dyn Backend>>) {
        let _ = self.placement.set((placement, gpu));
        self.ready.store(true, Ordering::Release);
    }

    pub fn response(&self, status: u16) {
        if let Ok(mut m) = self.responses.lock() {
            *m.entry(status).or_default() += 1;
        }
    }

    pub fn queued(&self) {
        self.queue_depth.fetch_add(1, Ordering::Relaxed);
    }

    /// A job left the queue (to run, or dropped because its client had gone).
    pub fn dequeued(&self) {
        let _ = self
            .queue_depth
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                Some(d.saturating_sub(1))
            });
    }

    pub fn started(&self, queue_wait_s: f64) {
        self.running.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut l) = self.latencies.lock() {
            l.queue_wait.observe(queue_wait_s);
        }
    }

    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// A running generation ended.
    fn stopped(&self) {
        let _ = self
            .running
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                Some(d.saturating_sub(1))
            });
    }

    /// One decode step ran `batch` sequences together.
    pub fn decode_step(&self, batch: usize) {
        self.batch_size.store(batch, Ordering::Relaxed);
        self.decode_steps.fetch_add(1, Ordering::Relaxed);
        self.decode_tokens
            .fetch_add(batch as u64, Ordering::Relaxed);
    }

    /// No sequence is decoding.
    pub fn idle(&self) {
        self.batch_size.store(0, Ordering::Relaxed);
    }

    pub fn failed(&self) {
        self.stopped();
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// A request's end: its token counts, and its first-token and per-token latencies (ms).
    pub fn finished(&self, o: &Outcome, ttft_ms: f64, tpot_ms: f64, cancelled: bool) {
        self.stopped();
        if cancelled {
            self.cancelled();
        } else {
            self.completed.fetch_add(1, Ordering::Relaxed);
        }
        self.prompt_tokens
            .fetch_add(o.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(o.cached_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(o.completion_tokens as u64, Ordering::Relaxed);
        if let Ok(mut l) = self.latencies.lock() {
            if o.completion_tokens > 0 {
                l.ttft.observe(ttft_ms / 1e3);
            }
            if o.completion_tokens > 1 {
                l.tpot.observe(tpot_ms / 1e3);
            }
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let lu = |a: &AtomicUsize| a.load(Ordering::Relaxed) as u64;
        let scalars: [(&str, &str, &str, u64); 14] = [
            (
                "oato_ready",
                "gauge",
                "1 once the model is loaded and placed.",
                u64::from(self.is_ready()),
            ),
            (
                "oato_requests_completed_total",
                "counter",
                "Generations that ran to their end.",
                ld(&self.completed),
            ),
            (
                "oato_requests_cancelled_total",
                "counter",
                "Generations stopped because their client disconnected.",
                ld(&self.cancelled),
            ),
            (
                "oato_requests_failed_total",
                "counter",
                "Generations that failed in the engine.",
                ld(&self.failed),
            ),
            (
                "oato_prompt_tokens_total",
                "counter",
                "Prompt tokens of the generations.",
                ld(&self.prompt_tokens),
            ),
            (
                "oato_prompt_tokens_cached_total",
                "counter",
                "Prompt tokens whose keys and values were reused from an earlier request.",
                ld(&self.cached_tokens),
            ),
            (
                "oato_completion_tokens_total",
                "counter",
                "Generated tokens.",
                ld(&self.completion_tokens),
            ),
            (
                "oato_queue_depth",
                "gauge",
                "Requests waiting for the engine.",
                lu(&self.queue_depth),
            ),
            (
                "oato_queue_capacity",
                "gauge",
                "Requests that may wait before new ones get 503.",
                lu(&self.queue_capacity),
            ),
            (
                "oato_requests_running",
                "gauge",
                "Generations running now.",
                lu(&self.running),
            ),
            (
                "oato_parallel",
                "gauge",
                "Sequences that may decode together in one batch (--parallel).",
                lu(&self.parallel),
            ),
            (
                "oato_batch_size",
                "gauge",
                "Sequences in the last decode step (0 when none is decoding).",
                lu(&self.batch_size),
            ),
            (
                "oato_decode_steps_total",
                "counter",
                "Decode steps: one forward pass over every decoding sequence.",
                ld(&self.decode_steps),
            ),
            (
                "oato_decode_step_tokens_total",
                "counter",
                "Tokens of the decode steps (over oato_decode_steps_total: the mean batch size).",
                ld(&self.decode_tokens),
            ),
        ];
        for (name, kind, help, v) in scalars {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP oato_http_responses_total Responses by HTTP status.\n\
             # TYPE oato_http_responses_total counter"
        );
        if let Ok(m) = self.responses.lock() {
            for (code, n) in m.iter() {
                let _ = writeln!(out, "oato_http_responses_total{{code=\"{code}\"}} {n}");
            }
        }
        if let Ok(l) = self.latencies.lock() {
            l.ttft.write(
                &mut out,
                "oato_ttft_seconds",
                "Time to first token: the prompt's prefill and the first sample.",
            );
            l.tpot.write(
                &mut out,
                "oato_tpot_seconds",
                "Mean time per output token after the first, per request.",
            );
            l.queue_wait.write(
                &mut out,
                "oato_queue_wait_seconds",
                "Time a request waited in the queue.",
            );
        }
        if let Some((p, gpu)) = self.placement.get() {
            let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "# HELP oato_placement_info Where the model runs.\n\
                 # TYPE oato_placement_info gauge\n\
                 oato_placement_info{{device=\"{}\",policy=\"{}\"}} 1",
                esc(&p.device),
                esc(&p.policy)
            );
            let _ = writeln!(
                out,
                "# HELP oato_placement_weights Target weights, all and on the GPU.\n\
                 # TYPE oato_placement_weights gauge\n\
                 oato_placement_weights{{where=\"all\"}} {}\n\
                 oato_placement_weights{{where=\"gpu\"}} {}",
                p.weights, p.gpu_weights
            );
            let _ = writeln!(
                out,
                "# HELP oato_placement_gpu_weight_bytes Bytes of weights resident on the GPU.\n\
                 # TYPE oato_placement_gpu_weight_bytes gauge\n\
                 oato_placement_gpu_weight_bytes {}",
                p.gpu_weight_bytes
            );
            if let Some(g) = gpu {
                let u = g.usage();
                let _ = writeln!(
                    out,
                    "# HELP oato_gpu_memory_bytes GPU memory: oato's by use, and the device's free and total.\n\
                     # TYPE oato_gpu_memory_bytes gauge\n\
                     oato_gpu_memory_bytes{{kind=\"weights\"}} {}\n\
                     oato_gpu_memory_bytes{{kind=\"kv_cache\"}} {}\n\
                     oato_gpu_memory_bytes{{kind=\"workspace\"}} {}",
                    u.weights, u.kv_cache, u.workspace
                );
                if let Ok(m) = g.memory() {
                    let _ = writeln!(
                        out,
                        "oato_gpu_memory_bytes{{kind=\"free\"}} {}\n\
                         oato_gpu_memory_bytes{{kind=\"total\"}} {}",
                        m.free, m.total
                    );
                }
            }
        }
        out
    }
}
