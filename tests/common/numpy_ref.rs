//! Float64 numpy references of tiny random-weight models (scripts/make-*-fixture.py write
//! `tests/data/<arch>/reference.json` beside the GGUF): loading them, and the checks every
//! architecture's reference test makes with them (prefill logits, greedy decode, batched prefill
//! against token by token).

use std::path::PathBuf;

use oato::model::Model;
use oato::runtime::forward::{Logits, Session};
// The first index among equals, as numpy's argmax.
use oato::runtime::sampler::argmax;

/// A reference.json and the model file beside it.
pub struct Reference {
    pub dir: PathBuf,
    pub prompt: Vec<u32>,
    /// [n_prompt][n_vocab]
    pub logits: Vec<Vec<f64>>,
    pub f16_logits: Vec<Vec<f64>>,
    pub f16_dev: f64,
    pub greedy: Vec<u32>,
    pub runner_up: Vec<u32>,
    pub margins: Vec<f64>,
    /// (bug, max |logit change|)
    pub sensitivity: Vec<(String, f64)>,
    pub settings: serde_json::Value,
    /// The whole file, for an architecture's own entries.
    pub json: serde_json::Value,
}

/// Bounds of one fixture's checks.
#[derive(Clone, Copy, Debug)]
pub struct Tolerances {
    /// Largest |engine - exact reference| on any logit.
    pub exact: f64,
    /// Largest |engine - reference with the engine's f16 rounding emulated|.
    pub f16_emulated: f64,
    /// Largest difference between a batched prefill and the same tokens one at a time.
    pub batch_vs_step: f64,
}

pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .expect("array of numbers")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

pub fn rows(v: &serde_json::Value) -> Vec<Vec<f64>> {
    v.as_array()
        .expect("array of rows")
        .iter()
        .map(floats)
        .collect()
}

impl Reference {
    /// `tests/data/<name>/reference.json`.
    pub fn load(name: &str) -> Reference {
        let dir = super::repo().join("tests/data").join(name);
        let path = dir.join("reference.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let j: serde_json::Value = serde_json::from_str(&text).expect("reference.json parses");
        let sensitivity = j["sensitivity"]
            .as_object()
            .expect("sensitivity")
            .iter()
            .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
            .collect();
        Reference {
            dir,
            prompt: super::ids(&j["prompt"]),
            logits: rows(&j["logits"]),
            f16_logits: rows(&j["f16_emulated"]["logits"]),
            f16_dev: j["f16_emulated"]["max_abs_dev_from_exact"]
                .as_f64()
                .expect("f16 deviation"),
            greedy: super::ids(&j["greedy"]),
            runner_up: super::ids(&j["greedy_runner_up"]),
            margins: floats(&j["greedy_margins"]),
            sensitivity,
            settings: j["settings"].clone(),
            json: j,
        }
    }

    /// The model file `file` beside the reference.
    pub fn model(&self, file: &str) -> Model {
        let path = self.dir.join(file);
        Model::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// A setting as an integer.
    pub fn u(&self, key: &str) -> usize {
        self.settings[key]
            .as_u64()
            .unwrap_or_else(|| panic!("setting {key}")) as usize
    }

    /// The bounds are reasoned against the fixture: room for the f16 rounding the script
    /// measured, far below what each simulated bug costs, and every greedy step decisive.
    pub fn check_tolerances(&self, tol: &Tolerances, f16_room: f64, bug_factor: f64) {
        assert!(
            f16_room * self.f16_dev <= tol.exact,
            "f16 rounding costs {:.3e} on this fixture; the exact bound {:.0e} is too tight",
            self.f16_dev,
            tol.exact
        );
        for (bug, change) in &self.sensitivity {
            assert!(
                *change >= bug_factor * tol.exact,
                "bug {bug:?} moves the logits by only {change:.3e}; the bound {:.0e} would not see it",
                tol.exact
            );
        }
        for (i, &m) in self.margins.iter().enumerate() {
            assert!(
                m > 2.0 * tol.exact,
                "greedy step {i}: reference top-2 margin {m:.3e} is a near-tie"
            );
        }
        let last: Vec<f32> = self
            .logits
            .last()
            .unwrap()
            .iter()
            .map(|&v| v as f32)
            .collect();
        assert_eq!(argmax(&last), self.greedy[0]);
    }
}

/// The largest |ours - theirs| over [n_tok, n_vocab] logits, and where: (error, position, token id).
pub fn max_abs_err(ours: &[f32], theirs: &[Vec<f64>], n_vocab: usize) -> (f64, usize, usize) {
    assert_eq!(
        ours.len(),
        theirs.len() * n_vocab,
        "logits of {} positions",
        theirs.len()
    );
    let mut worst = (0.0, 0, 0);
    for (pos, row) in theirs.iter().enumerate() {
        assert_eq!(row.len(), n_vocab);
        for (id, &want) in row.iter().enumerate() {
            let err = (ours[pos * n_vocab + id] as f64 - want).abs();
            // A NaN is reported, not skipped.
            if err > worst.0 || (err.is_nan() && !worst.0.is_nan()) {
                worst = (err, pos, id);
            }
        }
    }
    worst
}

/// Prefill logits at every position against the exact and the f16-emulated reference rows, and
/// the argmax at every position; returns the two largest errors.
pub fn check_logits(
    what: &str,
    logits: &[f32],
    exact: &[Vec<f64>],
    f16: &[Vec<f64>],
    n_vocab: usize,
    tol: &Tolerances,
) -> (f64, f64) {
    let (err, pos, id) = max_abs_err(logits, exact, n_vocab);
    let (err16, pos16, id16) = max_abs_err(logits, f16, n_vocab);
    eprintln!(
        "{what}: max |engine - exact| = {err:.3e} at position {pos}, id {id} (engine {:.6}, \
         reference {:.6}); max |engine - f16-emulated| = {err16:.3e} at position {pos16}, id {id16}",
        logits[pos * n_vocab + id],
        exact[pos][id],
    );
    assert!(
        err <= tol.exact,
        "{what}: logit at position {pos}, id {id}: engine {} vs reference {} (|err| {err:.3e} > {:.0e})",
        logits[pos * n_vocab + id],
        exact[pos][id],
        tol.exact
    );
    assert!(
        err16 <= tol.f16_emulated,
        "{what}: logit at position {pos16}, id {id16}: engine {} vs f16-emulated reference {} \
         (|err| {err16:.3e} > {:.0e})",
        logits[pos16 * n_vocab + id16],
        f16[pos16][id16],
        tol.f16_emulated
    );
    for (p, row) in exact.iter().enumerate() {
        let want: Vec<f32> = row.iter().map(|&v| v as f32).collect();
        assert_eq!(
            argmax(&logits[p * n_vocab..(p + 1) * n_vocab]),
            argmax(&want),
            "{what}: argmax at position {p}"
        );
    }
    (err, err16)
}

/// Prefill, then the reference's greedy tokens fed back one at a time: each step's argmax must be
/// the reference's next token, and the engine's gap between the reference's top two within
/// 2 * `tol.exact` of the reference's margin (a step whose margin were below that could pick the
/// runner-up).
pub fn check_greedy(m: &Model, r: &Reference, tol: &Tolerances) {
    let mut s = Session::new(m, 64).unwrap();
    let mut last = s.forward(&r.prompt, Logits::Last).expect("prefill");
    let mut ours = Vec::new();
    let mut worst_margin_err = (0.0f64, 0usize);
    for (i, &want) in r.greedy.iter().enumerate() {
        assert_eq!(last.len(), m.hp.n_vocab);
        let got = argmax(&last);
        ours.push(got);
        let gap = last[want as usize] as f64 - last[r.runner_up[i] as usize] as f64;
        let gap_err = (gap - r.margins[i]).abs();
        if gap_err > worst_margin_err.0 {
            worst_margin_err = (gap_err, i);
        }
        if got != want {
            let near_tie = r.margins[i] <= 2.0 * tol.exact;
            assert!(
                near_tie && got == r.runner_up[i],
                "greedy step {i}: engine picks {got}, reference {want} (reference margin {:.4} over \
                 {}; engine gap {gap:.4}); engine so far {ours:?}, reference {:?}",
                r.margins[i],
                r.runner_up[i],
                r.greedy
            );
        }
        assert!(
            gap_err <= 2.0 * tol.exact,
            "greedy step {i}: engine's logit gap {gap:.5} between {want} and {} differs from the \
             reference's {:.5} by {gap_err:.3e}",
            r.runner_up[i],
            r.margins[i]
        );
        last = s.forward(&[want], Logits::Last).expect("decode step");
    }
    eprintln!(
        "greedy: engine {ours:?}, reference {:?}; largest top-2 gap error {:.3e} at step {}",
        r.greedy, worst_margin_err.0, worst_margin_err.1
    );
    assert_eq!(s.n_past, r.prompt.len() + r.greedy.len());
}

/// The KV cache: one batched prefill and the same prompt decoded one token at a time agree at
/// every position, the token-by-token logits match the reference, and `Logits::Last` of a
/// prefill is the last row of `Logits::All`.
pub fn check_batched_vs_steps(m: &Model, r: &Reference, tol: &Tolerances) {
    let n_vocab = m.hp.n_vocab;
    let mut batched = Session::new(m, 64).unwrap();
    let all = batched
        .forward(&r.prompt, Logits::All)
        .expect("batched prefill");
    let mut stepped = Session::new(m, 64).unwrap();
    let mut steps = Vec::with_capacity(all.len());
    for &tok in &r.prompt {
        steps.extend(stepped.forward(&[tok], Logits::Last).expect("decode step"));
    }
    assert_eq!(steps.len(), all.len());
    let as_rows: Vec<Vec<f64>> = all
        .chunks(n_vocab)
        .map(|row| row.iter().map(|&v| v as f64).collect())
        .collect();
    let (err, pos, id) = max_abs_err(&steps, &as_rows, n_vocab);
    let last = r.prompt.len() - 1;
    let (err_ref, pos_ref, id_ref) = max_abs_err(&steps, &r.logits, n_vocab);
    eprintln!(
        "batched vs token-by-token: max |diff| {err:.3e} at position {pos}, id {id}; \
         token-by-token vs reference {err_ref:.3e} at position {pos_ref}, id {id_ref}"
    );
    assert!(
        err <= tol.batch_vs_step,
        "position {pos}, id {id}: batched {} vs token-by-token {} (|diff| {err:.3e} > {:.0e})",
        all[pos * n_vocab + id],
        steps[pos * n_vocab + id],
        tol.batch_vs_step
    );
    assert!(
        err_ref <= tol.exact,
        "token-by-token vs reference: {err_ref:.3e} at position {pos_ref}, id {id_ref}"
    );
    let mut again = Session::new(m, 64).unwrap();
    let last_only = again
        .forward(&r.prompt, Logits::Last)
        .expect("prefill, last logits");
    let (err_ll, _, id_ll) = max_abs_err(&last_only, &as_rows[last..], n_vocab);
    assert!(
        err_ll <= 1e-5,
        "Logits::Last vs last row of Logits::All: {err_ll:.3e} at id {id_ll}"
    );
}
