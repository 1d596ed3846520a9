//! Decode's weight matrices one after the other as a model reads them, timed per kind, out of
//! cache on the CPU pool: `cargo run --release --example decode_mix -- TYPE [THREADS] [LAYERS]`.
//! Without `MODEL`, random weights of type TYPE in the Llama-3.2-1B shape (per layer q/k/v as one
//! 2048 x 3072 matrix, attn_output 2048 x 2048, gate/up 2048 x 16384, ffn_down 8192 x 2048; 16
//! layers). `MODEL=file.gguf` takes each layer's attn_q, attn_output, ffn_gate and ffn_down and
//! the output head from that file instead, each of its own type (the kernels then see real
//! scales), and with `RANDOMIZE=1` the same matrices filled with random quants and one scale, so
//! the two differ in their bytes only. `INTERLEAVE=1` keeps the types that have it in the
//! interleaved layout (`repack`), as the engine does on AVX-512 CPUs. `ONLY=kind` keeps one kind,
//! `ROUNDS=n` (default 20) rounds over every matrix; prints each round's GB/s of weights per kind.
//! `FRESH_ACTS=1` quantises activations of other values before each product (outside the
//! timing), as decode's change from matrix to matrix (1B Q4_0 file, 1 thread: no slower).
//! `ALL=1` (with `MODEL`) adds attn_k, attn_v and ffn_up, run in one job with attn_q and
//! ffn_gate as the engine runs them.
//! The activations are random (`kernels::cpu::random_acts`), as decode's; `ACTS=sin` gives the
//! smooth sine this used before, whose blocks share one scale: against it the kernels that took
//! their scales from a 256 KiB table of every f16 read 10-15% faster than the engine did.
//! `ENGINE=1` (with `MODEL` and `ALL`) runs one token of the engine's own decode (a `Session` on
//! the file) before each round, and `BACKEND=1` the same matrices loaded and run by a CPU
//! backend (`load_matmul_weight`, `Backend::matmul`, the engine's jobs) after it: three ways to
//! read the same bytes within the same second of this machine's drifting memory rate.
//! `PLAIN=1` adds a plain read of every matrix's copy each round (a sum of its words, split over
//! the threads as `examples/matmul_dram`'s), the ceiling to set the others against. The engine's
//! session goes back to position 0 every 64 rounds (attention deep in a context is not what this
//! times); with `OATO_TRACE_STEPS=1` each round also prints the engine's own matmul steps per
//! kind (`e.q`, `e.o`, `e.gate`, `e.down`, `e.head`, GB/s) and the microseconds of its other
//! steps (`e.other_us`). `GAP_US=n` makes every other round wait n microseconds before each of
//! its jobs (outside the timing; those rounds' kinds are printed as `g.q` ...), as the engine's
//! small steps hold its matmuls apart.

use std::collections::BTreeMap;
use std::time::Instant;

use oato::kernels::cpu::matmul::{Layout, MatRef, QuantizedActs, matmul_quantized_many};
use oato::kernels::cpu::repack::{self, Arena, Piece};
use oato::quant::GgmlType;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ty = GgmlType::from_name(args.first().map_or("Q8_0", |s| s.as_str()))
        .expect("TYPE: a GGML type name");
    let threads: usize = args
        .get(1)
        .map_or(1, |v| v.parse().expect("THREADS: a number"));
    let layers: usize = args
        .get(2)
        .map_or(16, |v| v.parse().expect("LAYERS: a number"));
    let rounds: usize = std::env::var("ROUNDS").map_or(20, |v| v.parse().expect("ROUNDS"));
    let only = std::env::var("ONLY").ok();
    let randomize = std::env::var_os("RANDOMIZE").is_some();
    oato::kernels::cpu::pool::set_threads(threads);
    let arena = Arena::default();
    let mut rng = oato::rng::SplitMix64::new(0x9E37_79B9_7F4A_7C15);
    // Random quants, every block's scales alike (as `examples/matmul_dram`'s).
    let mut random =
        |ty: GgmlType, w: &mut [u8]| oato::kernels::cpu::random_blocks(ty, w, &mut rng, |_| 0.002);
    // (kind, type, k, n, copy, interleaved)
    let mut mats: Vec<(&str, GgmlType, usize, usize, Piece, bool)> = Vec::new();
    let interleave = std::env::var_os("INTERLEAVE").is_some();
    let copy = |ty: GgmlType, bytes: &[u8], k: usize, n: usize| -> (Piece, bool) {
        if interleave && repack::repacks(ty, k, n) {
            let p = repack::pack(ty, bytes, k, n, threads, &arena).expect("an interleaved copy");
            (p, true)
        } else {
            (arena.copy(bytes, threads).expect("a copy"), false)
        }
    };
    let keep = |kind: &str| only.as_deref().is_none_or(|o| o == kind);
    // ALL=1 (with MODEL): attn_k, attn_v and ffn_up too, each run in one job with the matrix
    // before it of its kind (`matmul_quantized_many`), as the engine runs q/k/v and gate/up.
    let all = std::env::var_os("ALL").is_some();
    // The file, opened once for its matrices here and for ENGINE / BACKEND below.
    let file_model = std::env::var("MODEL")
        .ok()
        .map(|path| oato::model::Model::open(&path).expect("MODEL: a GGUF model"));
    if let Some(model) = &file_model {
        let mut ws: Vec<(&str, &oato::model::WeightRef)> = Vec::new();
        for l in &model.layers {
            let q = l.wq.as_ref().expect("a model with attn_q");
            if all {
                // Every matrix, in the engine's order, q/k/v and gate/up as its fused jobs.
                let k = l.wk.as_ref().expect("a model with attn_k");
                let v = l.wv.as_ref().expect("a model with attn_v");
                ws.extend([
                    ("q", q),
                    ("q", k),
                    ("q", v),
                    ("o", &l.wo),
                    ("gate", &l.w_gate),
                    ("gate", &l.w_up),
                    ("down", &l.w_down),
                ]);
                continue;
            }
            ws.extend([
                ("q", q),
                ("o", &l.wo),
                ("gate", &l.w_gate),
                ("down", &l.w_down),
            ]);
        }
        ws.push(("head", &model.output));

        for (kind, w) in ws.into_iter().filter(|(kind, _)| keep(kind)) {
            let mut bytes = w.bytes(&model.file).expect("the weight's bytes").to_vec();
            if randomize {
                random(w.ty, &mut bytes);
            }
            let (piece, il) = copy(w.ty, &bytes, w.k, w.n);
            mats.push((kind, w.ty, w.k, w.n, piece, il));
        }
    } else {
        let kinds = [
            ("qkv", 2048, 3072),
            ("o", 2048, 2048),
            ("gateup", 2048, 16384),
            ("down", 8192, 2048),
        ];
        for _ in 0..layers {
            for &(kind, k, n) in kinds.iter().filter(|(kind, _, _)| keep(kind)) {
                let mut data = vec![0u8; ty.row_bytes(k).expect("K fits the type") * n];
                random(ty, &mut data);
                let (piece, il) = copy(ty, &data, k, n);
                mats.push((kind, ty, k, n, piece, il));
            }
        }
    }
    // Activations of k values (the `salt`-th set): random, or with ACTS=sin a smooth sine.
    let sine = std::env::var("ACTS").is_ok_and(|v| v == "sin");
    let values = |k: usize, salt: usize| -> Vec<f32> {
        if sine {
            (0..k)
                .map(|i| ((i + 7 * salt) as f32 * 0.37).sin() * (1.0 + (salt % 13) as f32))
                .collect()
        } else {
            let seed = 0x5EED ^ (salt as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            oato::kernels::cpu::random_acts(k, &mut oato::rng::SplitMix64::new(seed))
        }
    };
    let mut acts: BTreeMap<(GgmlType, usize), QuantizedActs> = BTreeMap::new();
    for &(_, ty, k, _, _, _) in &mats {
        acts.entry((ty.vec_dot_type(), k))
            .or_insert_with(|| QuantizedActs::new(ty, &values(k, 0), k).expect("the activations"));
    }
    let most = mats.iter().map(|m| m.3).max().unwrap_or(0);
    let mut ys = vec![vec![0f32; most]; 3];
    let fresh = std::env::var_os("FRESH_ACTS").is_some();
    let mut calls = 0usize;
    // ENGINE=1 (with MODEL and ALL): the engine's own decode (a `Session` on the same file, its
    // own copies) one token per round, before each round here, in the same second of memory.
    let with_file = |flag: &str| {
        std::env::var_os(flag).map(|_| file_model.as_ref().expect("ENGINE / BACKEND take MODEL"))
    };
    let mut session = with_file("ENGINE")
        .map(|m| oato::runtime::forward::Session::new(m, 72).expect("an engine session"));
    // BACKEND=1 (with MODEL): the matrices loaded by a CPU backend as the engine loads them and
    // run through its `matmul`, one call per engine job, after each round here.
    use oato::runtime::backend::{Backend, Category, DType};
    let be = oato::runtime::cpu_backend::CpuBackend::new();
    let mut be_jobs = Vec::new();
    if let Some(m) = with_file("BACKEND") {
        let load = |w: &oato::model::WeightRef| be.load_matmul_weight(&m.file, w).expect("a load");
        for l in &m.layers {
            let (q, k, v) = (
                l.wq.as_ref().unwrap(),
                l.wk.as_ref().unwrap(),
                l.wv.as_ref().unwrap(),
            );
            be_jobs.push(vec![load(q), load(k), load(v)]);
            be_jobs.push(vec![load(&l.wo)]);
            be_jobs.push(vec![load(&l.w_gate), load(&l.w_up)]);
            be_jobs.push(vec![load(&l.w_down)]);
        }
        be_jobs.push(vec![load(&m.output)]);
    }
    let total: usize = if be_jobs.is_empty() {
        mats.iter().map(|m| m.4.bytes().len()).sum()
    } else {
        be_jobs.iter().flatten().map(|w| w.bytes).sum()
    };
    // The engine's traced matmul steps: (step name's start, kind, bytes a token reads).
    let step_kinds: Vec<(&str, &str, usize)> = file_model.as_ref().map_or(Vec::new(), |m| {
        let sum = |f: &dyn Fn(&oato::model::LayerWeights) -> usize| m.layers.iter().map(f).sum();
        let opt = |w: Option<&oato::model::WeightRef>| w.map_or(0, |w| w.n_bytes);
        vec![
            (
                "matmul attn_q",
                "e.q",
                sum(&|l| opt(l.wq.as_ref()) + opt(l.wk.as_ref()) + opt(l.wv.as_ref())),
            ),
            ("matmul attn_output", "e.o", sum(&|l| l.wo.n_bytes)),
            (
                "matmul ffn_gate",
                "e.gate",
                sum(&|l| l.w_gate.n_bytes + l.w_up.n_bytes),
            ),
            ("matmul ffn_down", "e.down", sum(&|l| l.w_down.n_bytes)),
            ("matmul output", "e.head", m.output.n_bytes),
        ]
    });
    // The bytes of every matrix a decode step reads (the engine's rate; `total` can hold
    // fewer, with ONLY).
    let engine_bytes: usize = step_kinds.iter().map(|k| k.2).sum();
    let gap_us: u128 = std::env::var("GAP_US").map_or(0, |v| v.parse().expect("GAP_US"));
    let plain = std::env::var_os("PLAIN").is_some();
    let read = |bytes: &[u8]| std::hint::black_box(oato::kernels::cpu::plain_read(bytes));
    let start = Instant::now();
    for round in 0..rounds {
        let engine = session.as_mut().map(|s| {
            // Positions 0..64 over and over: attention deep in a context is not what this
            // times.
            if round % 64 == 0 {
                s.reset();
            }
            let t0 = Instant::now();
            s.forward(&[1 + round as u32], oato::runtime::forward::Logits::Last)
                .expect("a decode step");
            let mut line = format!(
                "engine {:.1}  ",
                engine_bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
            );
            // With OATO_TRACE_STEPS: the engine's matmul steps per kind (GB/s), and the
            // microseconds of every other step together.
            if let Some(times) = s.take_step_times() {
                let mut kinds: BTreeMap<&str, f64> = BTreeMap::new();
                for (op, secs) in times.into_iter().filter(|t| !t.0.starts_with("(whole")) {
                    let kind = step_kinds
                        .iter()
                        .find(|(name, _, _)| op.starts_with(name))
                        .map_or("e.other_us", |k| k.1);
                    *kinds.entry(kind).or_default() += secs;
                }
                for (kind, secs) in kinds {
                    match step_kinds.iter().find(|k| k.1 == kind) {
                        Some(k) => line += &format!("{kind} {:.1}  ", k.2 as f64 / secs / 1e9),
                        None => line += &format!("{kind} {:.1}  ", secs * 1e6),
                    }
                }
            }
            line
        });
        let mut per: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        // One job per matrix, and with ALL per run of matrices of the same kind.
        for job in mats.chunk_by(|x, y| all && x.0 == y.0) {
            let (kind, ty, k) = (job[0].0, job[0].1, job[0].2);
            // FRESH_ACTS=1: activations of other values before each job, as decode's change
            // from matrix to matrix (quantised outside the timing).
            let fresh_acts = fresh.then(|| {
                calls += 1;
                QuantizedActs::new(ty, &values(k, calls), k).expect("the activations")
            });
            let a = fresh_acts
                .as_ref()
                .unwrap_or(&acts[&(ty.vec_dot_type(), k)]);
            assert!(
                job.len() <= ys.len(),
                "an output for each matrix of the job"
            );
            let mut parts: Vec<(MatRef, &mut [f32])> = job
                .iter()
                .zip(ys.iter_mut())
                .map(|((_, ty, k, n, piece, il), y)| {
                    let mut m = MatRef::rows(*ty, *k, *n, piece.bytes());
                    if *il {
                        m.layout = Layout::Interleaved;
                    }
                    (m, &mut y[..*n])
                })
                .collect();
            // GAP_US=n: every other round waits n microseconds before each job (outside the
            // timing), as the engine's small steps hold its matmuls apart; those rounds'
            // kinds are printed with a "g." in front.
            let kind = if gap_us > 0 && round % 2 == 1 {
                let t = Instant::now();
                while t.elapsed().as_micros() < gap_us {
                    std::hint::spin_loop();
                }
                format!("g.{kind}")
            } else {
                kind.to_string()
            };
            let t0 = Instant::now();
            matmul_quantized_many(&mut parts, a).expect("a product");
            let e = per.entry(kind).or_default();
            e.0 += t0.elapsed().as_secs_f64();
            e.1 += job.iter().map(|m| m.4.bytes().len()).sum::<usize>();
        }
        let mut be_s = 0.0;
        for job in &be_jobs {
            let k = job[0].k;
            let mut x = be.alloc(DType::F32, k, Category::Workspace).expect("x");
            let xs = values(k, round + 1);
            be.write(&mut x, 0, &xs).expect("write");
            let mut ys: Vec<_> = job
                .iter()
                .map(|w| be.alloc(DType::F32, w.n, Category::Workspace).expect("y"))
                .collect();
            let mut yr: Vec<_> = ys.iter_mut().collect();
            let refs: Vec<_> = job.iter().collect();
            let t0 = Instant::now();
            be.matmul(&refs, &x, 1, &mut yr).expect("a product");
            be_s += t0.elapsed().as_secs_f64();
        }
        if !be_jobs.is_empty() {
            per.insert("backend".into(), (be_s, total));
        }
        // PLAIN=1: a plain read of every matrix's copy (a sum of its words on the pool), the
        // ceiling for the rounds' products in the same second of memory.
        if plain {
            let t0 = Instant::now();
            for m in &mats {
                read(m.4.bytes());
            }
            let b = mats.iter().map(|m| m.4.bytes().len()).sum();
            per.insert("plain".into(), (t0.elapsed().as_secs_f64(), b));
        }
        let line: Vec<String> = per
            .iter()
            .map(|(kind, (s, b))| format!("{kind} {:.1}", *b as f64 / s / 1e9))
            .collect();
        println!(
            "round {round} at {:.1} s: {}{}",
            start.elapsed().as_secs_f64(),
            engine.unwrap_or_default(),
            line.join("  ")
        );
    }
}
