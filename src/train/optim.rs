//! AdamW hyper-parameters, the learning-rate schedule and the global-norm clip (DFLASH.md 4).

use crate::backend::AdamStep;

#[derive(Clone, Debug, PartialEq)]
pub struct OptimConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Fraction of the run spent in linear warmup.
    pub warmup_frac: f32,
    /// Global gradient-norm clip.
    pub clip: f32,
    pub total_steps: u32,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_frac: 0.04,
            clip: 1.0,
            total_steps: 1000,
        }
    }
}

impl OptimConfig {
    pub fn warmup_steps(&self) -> u32 {
        ((self.total_steps as f64 * f64::from(self.warmup_frac)).round() as u32).max(1)
    }

    /// Learning rate of 0-based step `step`: linear warmup to `lr`, then cosine to 0 at the end.
    pub fn lr_at(&self, step: u32) -> f32 {
        let warm = self.warmup_steps();
        if step < warm {
            return self.lr * (step + 1) as f32 / warm as f32;
        }
        let decay = self.total_steps.saturating_sub(warm).max(1);
        let t = (f64::from(step - warm) / f64::from(decay)).min(1.0);
        (f64::from(self.lr) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())) as f32
    }

    /// Clip factor for a global gradient norm.
    pub fn clip_scale(&self, grad_norm: f64) -> f32 {
        if self.clip > 0.0 && grad_norm > f64::from(self.clip) {
            (f64::from(self.clip) / (grad_norm + 1e-6)) as f32
        } else {
            1.0
        }
    }

    /// The AdamW update of 0-based step `step`.
    pub fn adam_step(&self, step: u32, grad_norm: f64) -> AdamStep {
        AdamStep {
            lr: self.lr_at(step),
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            t: step + 1,
            grad_scale: self.clip_scale(grad_norm),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_zero() {
        let c = OptimConfig { total_steps: 100, ..Default::default() };
        assert_eq!(c.warmup_steps(), 4);
        assert!((c.lr_at(0) - 6e-4 / 4.0).abs() < 1e-9);
        assert!((c.lr_at(3) - 6e-4).abs() < 1e-9);
        assert!((c.lr_at(4) - 6e-4).abs() < 1e-9);
        assert!(c.lr_at(50) < c.lr_at(10));
        assert!(c.lr_at(99) < 1e-6);
        assert!((c.lr_at(52) - 3e-4).abs() < 1e-9);
    }

    #[test]
    fn clip_only_above_threshold() {
        let c = OptimConfig::default();
        assert_eq!(c.clip_scale(0.5), 1.0);
        assert!((c.clip_scale(4.0) - 0.25).abs() < 1e-6);
    }
}
