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

#[cfg(test)]
mod tests {
    use super::*;

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
