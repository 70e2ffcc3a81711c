//! Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11, "Random123").
//!
//! Every random draw in training is a pure function of `(seed, step, domain, index)`, so the CPU
//! reference, the CUDA kernels (`kernels/philox.cuh`, the same rounds and the same bit-to-float
//! rule), any launch configuration and any replay after `--resume` see identical bits.

/// Philox multipliers and Weyl key increments (Random123's constants).
const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Independent streams: the fourth counter word names what the bits are for, so the noise of a
/// step can never repeat the anchor draw of the same step.
pub mod domain {
    /// Uniform noise added to the packed taps (DFLASH.md section 2).
    pub const NOISE: u32 = 0;
    /// Anchor sampling, keyed additionally by the sequence index.
    pub const ANCHORS: u32 = 1;
    /// Embedded default data: prompts and sampling.
    pub const DATA: u32 = 2;
    /// Random initialisation of weights (target presets and the drafter).
    pub const INIT: u32 = 3;
    /// Shuffling the order of samples per epoch.
    pub const SHUFFLE: u32 = 4;
}

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// One Philox4x32 block with 10 rounds: 128 random bits for a 128-bit counter and a 64-bit key.
#[inline]
pub fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            key[0] = key[0].wrapping_add(PHILOX_W0);
            key[1] = key[1].wrapping_add(PHILOX_W1);
        }
        let (hi0, lo0) = mulhilo(PHILOX_M0, ctr[0]);
        let (hi1, lo1) = mulhilo(PHILOX_M1, ctr[2]);
        ctr = [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0];
    }
    ctr
}

#[inline]
fn seed_key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// 24 high bits to a float in [0, 1): exact in f32, so every device makes the same value.
#[inline]
pub fn u32_to_unit_f32(r: u32) -> f32 {
    (r >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The 32 random bits for element `idx` of `(seed, step, domain)`. Four consecutive elements share
/// one Philox block (`idx / 4` is the counter, `idx % 4` picks the word), which is how the GPU
/// kernel draws them too.
#[inline]
pub fn bits_at(seed: u64, step: u32, domain: u32, idx: u64) -> u32 {
    let block = idx >> 2;
    let out = philox4x32_10([block as u32, (block >> 32) as u32, step, domain], seed_key(seed));
    out[(idx & 3) as usize]
}

/// Uniform in [0, 1) for element `idx`.
#[inline]
pub fn uniform_at(seed: u64, step: u32, domain: u32, idx: u64) -> f32 {
    u32_to_unit_f32(bits_at(seed, step, domain, idx))
}

/// The noise value added to packed element `idx`: `std * (2u - 1)`, uniform in `[-std, std)`.
/// `2u - 1` is exact in f32 (u has 24 bits); the product is one rounding, which the CUDA kernel
/// reproduces with `__fmul_rn` (no FMA contraction with the following add).
#[inline]
pub fn noise_at(seed: u64, step: u32, idx: u64, std: f32) -> f32 {
    let u = uniform_at(seed, step, domain::NOISE, idx);
    std * (2.0 * u - 1.0)
}

/// A sequential stream over the same counters, for host-side draws (anchors, init, data).
/// `Philox::new(seed, [a, b])` with `a, b` naming the stream (e.g. step and domain).
#[derive(Clone, Debug)]
pub struct Philox {
    key: [u32; 2],
    hi: [u32; 2],
    block: u64,
    buf: [u32; 4],
    used: usize,
}

impl Philox {
    /// A stream keyed by `seed`, with `stream` occupying the two high counter words.
    pub fn new(seed: u64, stream: [u32; 2]) -> Self {
        Self { key: seed_key(seed), hi: stream, block: 0, buf: [0; 4], used: 4 }
    }

    /// The same stream from its `block`-th Philox block on (`new` starts at block 0): draws that
    /// take whole blocks (`normal` takes exactly one) can be split across threads.
    pub fn at_block(seed: u64, stream: [u32; 2], block: u64) -> Self {
        Self { block, ..Self::new(seed, stream) }
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.used == 4 {
            let b = self.block;
            self.buf = philox4x32_10([b as u32, (b >> 32) as u32, self.hi[0], self.hi[1]], self.key);
            self.block += 1;
            self.used = 0;
        }
        let r = self.buf[self.used];
        self.used += 1;
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        (u64::from(self.next_u32()) << 32) | u64::from(self.next_u32())
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        u32_to_unit_f32(self.next_u32())
    }

    /// Uniform in [0, 1) with 53 bits, for f64 work on the host.
    pub fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// Uniform integer in `0..n` (n > 0), unbiased (rejection on the 64-bit draw).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Philox::below(0)");
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let r = self.next_u64();
            if r < zone {
                return r % n;
            }
        }
    }

    /// Standard normal (Box-Muller, f64 on the host).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform_f64(); // (0, 1]: ln is finite
        let u2 = self.uniform_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn normal_takes_one_block_so_streams_can_be_split() {
        let mut seq = Philox::new(9, [3, 4]);
        let all: Vec<f64> = (0..40).map(|_| seq.normal()).collect();
        for start in [0u64, 1, 17, 39] {
            let mut r = Philox::at_block(9, [3, 4], start);
            assert_eq!(r.normal().to_bits(), all[start as usize].to_bits(), "block {start}");
        }
    }

    use super::*;

    /// Known-answer vectors of Random123's `kat_vectors` for philox4x32_10.
    #[test]
    fn philox_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn element_bits_match_block_words() {
        let b = philox4x32_10([1, 0, 7, domain::NOISE], seed_key(42));
        for w in 0..4 {
            assert_eq!(bits_at(42, 7, domain::NOISE, 4 + w), b[w as usize]);
        }
    }

    #[test]
    fn noise_is_in_range_and_centred() {
        let n = 100_000u64;
        let mut sum = 0.0f64;
        for i in 0..n {
            let x = noise_at(3, 1, i, 0.05);
            assert!((-0.05..0.05).contains(&x), "{x}");
            sum += f64::from(x);
        }
        assert!((sum / n as f64).abs() < 1e-3);
    }

    #[test]
    fn streams_are_distinct_and_below_is_bounded() {
        let mut a = Philox::new(1, [0, domain::ANCHORS]);
        let mut b = Philox::new(1, [1, domain::ANCHORS]);
        assert_ne!(a.next_u64(), b.next_u64());
        let mut counts = [0u32; 7];
        for _ in 0..7000 {
            counts[a.below(7) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
    }
}
