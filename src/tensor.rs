//! Element types and the one rounding rule every backend shares.
//!
//! There is deliberately no tensor framework here: buffers belong to a backend (see
//! `backend::Backend`), and this module only names what a buffer stores and how a value becomes
//! bf16 (round to nearest, ties to even: the same as `__float2bfloat16_rn` on the GPU).

use half::bf16;

/// What a float buffer stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
        }
    }
}

/// Round an f32 to the nearest bf16 value (ties to even) and widen it back.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Host bf16 bytes from f32 values (used by checkpoints and uploads).
pub fn f32_to_bf16_bytes(v: &[f32]) -> Vec<u8> {
    let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    bytemuck::cast_slice(&h).to_vec()
}

/// The AdamW masters are split (DESIGN.md, memory): the f32 master's upper 16 bits are,
/// up to rounding, the bf16 weight the model computes with, so only its lower 16 bits are kept
/// beside the weight (2 bytes per parameter instead of 4 for a separate f32 copy).
///
/// `bf16(x)` rounds to nearest, ties to even, so the upper half `t` of `x` is `bf16(x)` (rounded
/// down) or `bf16(x) - 1` (rounded up) as bit patterns, and the lower half `lo` tells which:
/// up when `lo > 0x8000`, down when `lo < 0x8000`. `lo == 0x8000` (an exact tie) could be either,
/// so masters are kept off ties: [`master_off_tie`] moves such an `x` one f32 ulp toward
/// `bf16(x)`. That changes the master by 2^-24 of its value, on about one master in 65,536 per
/// update, keeps `bf16(x)` as it was, and makes the split exact. Every backend applies it, with
/// or without split masters, so they all compute the same masters bit for bit.
#[inline]
pub fn master_off_tie(x: f32) -> f32 {
    let b = x.to_bits();
    if b & 0xFFFF != 0x8000 || x.is_nan() {
        return x;
    }
    // Even upper half: the tie rounds down, so step down to lo = 0x7FFF; odd: up, to 0x8001.
    f32::from_bits(if (b >> 16) & 1 == 0 { b - 1 } else { b + 1 })
}

/// `(bf16 bits, lower 16 bits)` of a master that is off ties ([`master_off_tie`]).
#[inline]
pub fn master_split(x: f32) -> (u16, u16) {
    (bf16::from_f32(x).to_bits(), (x.to_bits() & 0xFFFF) as u16)
}

/// The master from its bf16 weight and lower half ([`master_split`]'s inverse; a NaN stays a NaN).
#[inline]
pub fn master_join(w: u16, lo: u16) -> f32 {
    let t = if lo > 0x8000 { w.wrapping_sub(1) } else { w };
    f32::from_bits((u32::from(t) << 16) | u32::from(lo))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_masters_round_trip_exactly() {
        let mut xs: Vec<f32> = vec![0.0, -0.0, 1.0, -1.0, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY];
        // Subnormals, carries into the exponent, both signs, every low half near the tie.
        for t in [0x0000u32, 0x0001, 0x007F, 0x3F7F, 0x3F80, 0xBF7F, 0x7F7F, 0x8000, 0x8001, 0xFF7F] {
            for lo in [0x0000u32, 0x0001, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0x8002, 0xFFFF] {
                xs.push(f32::from_bits((t << 16) | lo));
            }
        }
        let mut r = crate::rng::Philox::at_block(7, [0, 0], 0);
        xs.extend((0..100_000).map(|_| (0.02 * r.normal()) as f32));
        for &x0 in &xs {
            let x = master_off_tie(x0);
            // Off a tie nothing moves; on one, one ulp, and the bf16 weight stays what it was.
            if x0.to_bits() & 0xFFFF == 0x8000 {
                assert_eq!(x.to_bits().abs_diff(x0.to_bits()), 1, "{x0:e}");
            } else {
                assert_eq!(x.to_bits(), x0.to_bits(), "{x0:e}");
            }
            assert_eq!(bf16::from_f32(x).to_bits(), bf16::from_f32(x0).to_bits(), "{x0:e}");
            let (w, lo) = master_split(x);
            assert_eq!(master_join(w, lo).to_bits(), x.to_bits(), "{x:e}: w {w:#06x} lo {lo:#06x}");
        }
        let (w, lo) = master_split(master_off_tie(f32::NAN));
        assert!(master_join(w, lo).is_nan());
    }

    #[test]
    fn bf16_rounding_is_ties_to_even() {
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
    }
}
