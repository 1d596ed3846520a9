//! splitmix64: the crate's one small seeded generator (sampler seeds, `oato bench` token ids,
//! `oato synth` weights). Fast, reproducible across platforms, every seed usable (zero included).

/// Steele, Lea and Flood's splitmix64: a 64-bit counter stepped by the golden gamma, then mixed.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 24 random bits (every value is an exact f32).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in 0..n (0 when n is 0); the modulo bias is below n / 2^64.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Fills `out` with random bytes, eight from each step.
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let (chunks, rest) = out.as_chunks_mut::<8>();
        for c in chunks {
            *c = self.next_u64().to_le_bytes();
        }
        if !rest.is_empty() {
            let b = self.next_u64().to_le_bytes();
            rest.copy_from_slice(&b[..rest.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_splitmix64_sequence() {
        // Vigna's reference splitmix64.c seeded with 1234567.
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
        assert_eq!(r.next_u64(), 9817491932198370423);
    }

    #[test]
    fn floats_bytes_and_bounds_stay_in_range() {
        let mut r = SplitMix64::new(0);
        for _ in 0..1000 {
            let x = r.next_f32();
            assert!((0.0..1.0).contains(&x), "{x}");
            assert!(r.below(7) < 7);
        }
        assert_eq!(r.below(0), 0);
        let mut a = [0u8; 13];
        SplitMix64::new(5).fill_bytes(&mut a);
        let mut b = SplitMix64::new(5);
        assert_eq!(a[..8], b.next_u64().to_le_bytes());
        assert_eq!(a[8..], b.next_u64().to_le_bytes()[..5]);
    }
}
