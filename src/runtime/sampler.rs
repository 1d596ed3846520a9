//! Token sampling: repeat penalty, top-k, top-p, min-p, temperature, then a seeded draw; greedy
//! when the temperature is 0. The chain's order is llama.cpp's default.

use crate::rng::SplitMix64;

/// Sampling settings (llama.cpp's defaults).
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    /// How many recent tokens the repeat penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0x5EED,
        }
    }
}

/// A sampling setting out of its range: the field (`temperature`, `top_p`, `min_p`,
/// `repeat_penalty`), its value and the range it must be in.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfRange {
    pub field: &'static str,
    pub value: f32,
    pub range: &'static str,
}

/// A setting's name, value, range and test.
type RangeCheck = (&'static str, f32, &'static str, fn(f32) -> bool);

impl SamplerConfig {
    /// The first setting out of range, if any (NaN and infinities are out of every range).
    pub fn check(&self) -> std::result::Result<(), OutOfRange> {
        let checks: [RangeCheck; 4] = [
            ("temperature", self.temperature, ">= 0", |v| v >= 0.0),
            ("top_p", self.top_p, "(0, 1]", |v| v > 0.0 && v <= 1.0),
            ("min_p", self.min_p, "[0, 1]", |v| (0.0..=1.0).contains(&v)),
            ("repeat_penalty", self.repeat_penalty, "> 0", |v| v > 0.0),
        ];
        for (field, value, range, ok) in checks {
            if !value.is_finite() || !ok(value) {
                return Err(OutOfRange {
                    field,
                    value,
                    range,
                });
            }
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, reproducible across platforms.
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Self {
        let mut s = SplitMix64::new(seed);
        Rng([s.next_u64(), s.next_u64(), s.next_u64(), s.next_u64()])
    }
    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    pub cfg: SamplerConfig,
    rng: Rng,
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Sorts `cand` largest first, ties by id, keeping the first `k` (all for 0). A total order, so
/// selecting the top k first and sorting only them gives the same list as sorting everything:
/// a sort of a 128K vocabulary took about 5 ms a token (1B shape, `oato run`).
fn keep_top(cand: &mut Vec<(u32, f32)>, k: usize) {
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, order);
        cand.truncate(k);
    }
    cand.sort_by(order);
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = Rng::new(cfg.seed);
        Sampler { cfg, rng }
    }

    /// Picks the next token from `logits`, given the tokens so far (for the repeat penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let c = &self.cfg;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if c.repeat_penalty != 1.0 && c.repeat_last_n > 0 {
            let recent = &history[history.len().saturating_sub(c.repeat_last_n)..];
            let mut seen = std::collections::HashSet::new();
            for &t in recent {
                if seen.insert(t)
                    && let Some(e) = cand.get_mut(t as usize)
                {
                    e.1 = if e.1 <= 0.0 {
                        e.1 * c.repeat_penalty
                    } else {
                        e.1 / c.repeat_penalty
                    };
                }
            }
        }
        if c.temperature <= 0.0 {
            let l: Vec<f32> = cand.iter().map(|e| e.1).collect();
            return argmax(&l);
        }
        keep_top(&mut cand, c.top_k);
        // Probabilities of the remaining candidates (before temperature, as llama.cpp's chain).
        let probs = |cand: &[(u32, f32)]| -> Vec<f64> {
            let max = cand[0].1 as f64;
            let e: Vec<f64> = cand.iter().map(|x| (x.1 as f64 - max).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|v| v / s).collect()
        };
        if c.top_p < 1.0 {
            let p = probs(&cand);
            let mut cum = 0.0;
            let mut keep = cand.len();
            for (i, pi) in p.iter().enumerate() {
                cum += pi;
                if cum >= c.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if c.min_p > 0.0 {
            let p = probs(&cand);
            let thresh = p[0] * c.min_p as f64;
            let keep = p.iter().take_while(|&&pi| pi >= thresh).count();
            cand.truncate(keep.max(1));
        }
        for e in cand.iter_mut() {
            e.1 /= c.temperature;
        }
        let p = probs(&cand);
        let r = self.rng.next_f64();
        let mut cum = 0.0;
        for (i, pi) in p.iter().enumerate() {
            cum += pi;
            if r < cum {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_largest_and_penalty_can_change_it() {
        let logits = [0.5, 3.0, 2.9, -1.0];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits, &[]), 1);
        let mut s = Sampler::new(SamplerConfig {
            temperature: 0.0,
            repeat_penalty: 1.5,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits, &[1]), 2);
    }

    #[test]
    fn keeping_the_top_k_equals_sorting_everything() {
        let mut rng = crate::rng::SplitMix64::new(3);
        for (n, k) in [
            (1000, 40),
            (1000, 1),
            (1000, 999),
            (1000, 1000),
            (1000, 0),
            (5, 40),
        ] {
            // Few distinct values, so many ties (broken by id).
            let cand: Vec<(u32, f32)> = (0..n)
                .map(|i| (i as u32, (rng.below(50) as f32 - 25.0) * 0.5))
                .collect();
            let mut want = cand.clone();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            if k > 0 {
                want.truncate(k);
            }
            let mut got = cand;
            keep_top(&mut got, k);
            assert_eq!(got, want, "n {n} k {k}");
        }
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_reproduce() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let best = argmax(&logits);
        let mut s = Sampler::new(SamplerConfig {
            top_k: 1,
            ..Default::default()
        });
        for _ in 0..10 {
            assert_eq!(s.sample(&logits, &[]), best);
        }
        let draw = |seed| {
            let mut s = Sampler::new(SamplerConfig {
                seed,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                temperature: 5.0,
                ..Default::default()
            });
            (0..20).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        // Two strong candidates and a weak tail: min-p 0.5 keeps only the two.
        let mut logits = vec![-10.0f32; 50];
        logits[3] = 5.0;
        logits[9] = 4.8;
        let mut s = Sampler::new(SamplerConfig {
            min_p: 0.5,
            top_k: 0,
            top_p: 1.0,
            temperature: 1.0,
            ..Default::default()
        });
        for _ in 0..50 {
            let t = s.sample(&logits, &[]);
            assert!(t == 3 || t == 9, "{t}");
        }
        let mut s = Sampler::new(SamplerConfig {
            min_p: 0.0,
            top_k: 0,
            top_p: 0.5,
            temperature: 1.0,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&logits, &[]), 3);
        }
    }
}
