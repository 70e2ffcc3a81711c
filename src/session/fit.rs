//! Whether a run fits its devices, worked out from the shapes before the target loads (minutes
//! at the Qwen3.6-27B shape), so that a run that cannot fit says so at once instead of after the
//! load. Only buffers that are certainly on a device at the same time are counted, each at its
//! exact size, so every figure is a lower bound: what a device needs beyond it (activations
//! other than the gate|up products, logits, scratch, the CUDA context) only adds to it.
//!
//! Two moments are checked on every device:
//! - **Setup**, before the first step: the target's weights and every drafter parameter's full
//!   state, the AdamW moments included (they are created on the device and only then moved to host
//!   memory by `--offload-optimizer`). A device short of this cannot run at all: an error.
//! - **The end of the drafter's forward**, where the run's device peak lies: the same, less the
//!   moments if they are offloaded, plus the gate|up product every layer that is not parked keeps
//!   for the backward. How many blocks a micro-batch has depends on the data (each sequence gets
//!   as many as the batch's most drawn anchors), so this counts them as if every sequence drew its
//!   `--anchors` (or as many as its trained positions allow, if fewer), and a device short of it
//!   gets a warning with the flags that bring it down.
//!
//! Under `--split-fc` the fc group is created on each drafter device and then moves beside the
//! target, where it keeps its moments even with `--offload-optimizer`.

use anyhow::{bail, Result};

use super::setup::Topology;
use crate::backend::Backend;
use crate::model::drafter::DrafterShape;
use crate::model::target::{Target, TargetShape};

/// What a run puts on its devices, from its options.
pub struct FitPlan<'a> {
    pub target: &'a TargetShape,
    /// The deepest tapped layer: the target is loaded up to it.
    pub last_tap: usize,
    /// The drafter, `offload_layers` as the run parks them (0 where buffers are host memory).
    pub drafter: &'a DrafterShape,
    /// Block rows of one micro-batch whose sequences all draw as many anchors as they may:
    /// `--batch-size x min(--anchors, trained positions) x block size`.
    pub rows: usize,
    pub offload_optimizer: bool,
    pub split_fc: bool,
}

/// One thing a device holds, in bytes, and the moments it is held at.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    pub bytes: u64,
    pub what: String,
    pub at_setup: bool,
    pub at_peak: bool,
    /// AdamW moments that `--offload-optimizer` moves off this device after setup.
    pub offloadable: bool,
}

/// What one device holds at setup and at the end of the drafter's forward, at least.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Need {
    pub parts: Vec<Part>,
}

impl Need {
    pub fn setup(&self) -> u64 {
        self.parts.iter().filter(|p| p.at_setup).map(|p| p.bytes).sum()
    }
    pub fn peak(&self) -> u64 {
        self.parts.iter().filter(|p| p.at_peak).map(|p| p.bytes).sum()
    }
    fn push(&mut self, bytes: u64, what: String, at_setup: bool, at_peak: bool) {
        self.push_part(Part { bytes, what, at_setup, at_peak, offloadable: false });
    }
    fn push_part(&mut self, p: Part) {
        if p.bytes > 0 {
            self.parts.push(p);
        }
    }
    /// What `--offload-optimizer` would take off the peak.
    pub fn offloadable_at_peak(&self) -> u64 {
        self.parts.iter().filter(|p| p.offloadable && p.at_peak).map(|p| p.bytes).sum()
    }
}

/// Bytes a trained parameter holds on a GPU besides its AdamW moments: the bf16 weight, the low
/// half of its f32 master, its f32 gradient.
const PARAM_BYTES: u64 = 2 + 2 + 4;
/// The two f32 AdamW moments.
const MOMENT_BYTES: u64 = 8;

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The lower bounds of every device of `topo` (indexed as `topo.devices`).
pub fn needs<B: Backend>(plan: &FitPlan<'_>, topo: &Topology) -> Vec<Need> {
    let mut out = vec![Need::default(); topo.devices.len()];
    let (t, d) = (plan.target, plan.drafter);
    let target_bytes = Target::<B>::param_table(t, plan.last_tap).total() as u64 * 2;
    for &i in &topo.targets {
        out[i].push(
            target_bytes,
            format!("the target's weights, layers 0..={} with the embedding and lm_head (bf16)", plan.last_tap),
            true,
            true,
        );
    }
    let body = d.body_table().total() as u64;
    let fc = d.fc_table().total() as u64;
    // One trained group: `PARAM_BYTES` a parameter at `at_setup` / `at_peak`, and its moments,
    // which `--offload-optimizer` takes off the device after setup where `offloadable`.
    let group = |need: &mut Need, n: u64, name: &str, at_setup: bool, at_peak: bool, offloadable: bool| {
        need.push(
            n * PARAM_BYTES,
            format!(
                "{name}: {:.2} B trained parameters x {PARAM_BYTES} bytes (bf16 weight, master low half, f32 gradient)",
                n as f64 / 1e9
            ),
            at_setup,
            at_peak,
        );
        let moved = offloadable && plan.offload_optimizer;
        let where_ = match (moved, at_peak) {
            (true, _) => "created on the device, then moved to host memory",
            (false, true) => "on the device",
            (false, false) => "until the group moves beside the target",
        };
        need.push_part(Part {
            bytes: n * MOMENT_BYTES,
            what: format!("{name}: its AdamW moments, {MOMENT_BYTES} bytes a parameter ({where_})"),
            at_setup,
            at_peak: at_peak && !moved,
            offloadable,
        });
    };
    // Every rank creates its fc group. Under split-FC the first rank's then moves beside the
    // (first) target, moments and all (`offload_moments` does not reach it), and the others are
    // dropped.
    if plan.split_fc {
        group(&mut out[topo.targets[0]], fc, "the drafter's fc projection, beside the target", false, true, false);
    }
    let parked = d.offload_layers.min(d.layers);
    let kept = (d.layers - parked) as u64;
    let gate_up = d.gate_up_len(plan.rows) as u64 * 2;
    for &i in &topo.drafters {
        group(&mut out[i], body, "the drafter's layers", true, true, true);
        group(&mut out[i], fc, "the drafter's fc projection", true, !plan.split_fc, !plan.split_fc);
        // A rank off the first target's device gets copies (`setup::drafter_sides`).
        if i != topo.targets[0] {
            out[i].push(
                2 * (t.vocab * t.hidden) as u64 * 2,
                "the drafter's copies of the target's embedding and lm_head (bf16)".into(),
                true,
                true,
            );
        }
        out[i].push(
            kept * gate_up,
            format!(
                "the gate|up products {kept} of {} drafter layers keep for the backward ({} rows x {}, bf16; {parked} parked in host memory)",
                d.layers,
                plan.rows,
                2 * d.inter
            ),
            false,
            true,
        );
    }
    out
}

/// The parts of `need` held at setup or at the peak, a line each.
fn lines(need: &Need, at_setup: bool) -> String {
    need.parts
        .iter()
        .filter(|p| if at_setup { p.at_setup } else { p.at_peak })
        .map(|p| format!("\n  {:>8.2} GiB  {}", gib(p.bytes), p.what))
        .collect()
}

/// Errors when a device cannot hold the run's setup, warns (through `say`) when it cannot hold
/// the end of the drafter's forward; devices whose memory the backend cannot report (the CPU)
/// are not checked.
pub fn check<B: Backend>(
    bes: &[B],
    topo: &Topology,
    plan: &FitPlan<'_>,
    batch_size: usize,
    grad_accum: usize,
    say: &dyn Fn(String),
) -> Result<()> {
    for (k, need) in needs::<B>(plan, topo).iter().enumerate() {
        let Some((free, total)) = bes[k].device_memory() else { continue };
        let (free, total) = (free as u64, total as u64);
        let room = format!("{:.2} GiB of its {:.2} GiB are free", gib(free), gib(total));
        let name = bes[k].name();
        let (drafts, targets) = (topo.drafters.contains(&k), topo.targets.contains(&k));
        if need.setup() > free {
            let mut fixes = Vec::new();
            if drafts && targets {
                fixes.push("put the drafter on a GPU of its own (--drafter-gpus)");
            }
            if drafts {
                fixes.push("train a smaller drafter (--drafter-layers, --drafter-config)");
            } else {
                fixes.push("use a GPU with more memory for the target (--target-gpus)");
            }
            bail!(
                "the run cannot fit {name}: before the first step it holds at least {:.2} GiB there at once, and {room}:{}
What helps: {}; or free the device ({:.2} GiB of it is taken already, this process's CUDA context included)",
                gib(need.setup()),
                lines(need, true),
                fixes.join("; "),
                gib(total.saturating_sub(free))
            );
        }
        if need.peak() > free && drafts {
            let d = plan.drafter;
            let mut fixes = Vec::new();
            if need.offloadable_at_peak() > 0 {
                fixes.push(format!(
                    "--offload-optimizer (the AdamW moments in host memory: {:.2} GiB less; with --sync on one GPU their trip over PCIe runs beside the next target forward, so the step keeps its time: how the Qwen3.6-27B recipe trains on one 80 GB card)",
                    gib(need.offloadable_at_peak())
                ));
            }
            if d.offload_layers < d.layers {
                fixes.push(format!(
                    "--offload-activations {} (each parked layer's gate|up product in host memory: {:.2} GiB less)",
                    d.layers,
                    gib(d.gate_up_len(plan.rows) as u64 * 2)
                ));
            }
            if batch_size > 1 && batch_size % 2 == 0 {
                fixes.push(format!(
                    "--batch-size {} --grad-accum {} (the same sequences per step as smaller micro-batches: about half the activations)",
                    batch_size / 2,
                    grad_accum * 2
                ));
            }
            if targets {
                fixes.push("--drafter-gpus (the drafter on a GPU of its own)".into());
            }
            say(format!(
                "warning   {name}: at the end of the drafter's forward the run holds at least {:.2} GiB there when every sequence draws its anchors (activations, logits and scratch come on top), and {room}:{}\n          expect it to run out of device memory in the first step; what lowers it: {}",
                gib(need.peak()),
                lines(need, false),
                fixes.join("; ")
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::config::{DrafterConfig, TargetConfig};

    fn one_device() -> Topology {
        Topology { devices: vec![0], targets: vec![0], drafters: vec![0] }
    }

    /// The plan of a recipe: 4 sequences of 512 anchors, parking as given.
    fn need(target: &str, drafter: Option<&str>, parked: usize, offload: bool, topo: &Topology) -> Vec<Need> {
        need_split(target, drafter, parked, offload, false, topo)
    }

    fn need_split(
        target: &str,
        drafter: Option<&str>,
        parked: usize,
        offload: bool,
        split_fc: bool,
        topo: &Topology,
    ) -> Vec<Need> {
        let tcfg = TargetConfig::preset(target).unwrap();
        let dcfg = match drafter {
            Some(r) => DrafterConfig::recipe(r).unwrap(),
            None => DrafterConfig::for_target(&tcfg, 5, 16, None).unwrap(),
        };
        let shape = TargetShape::from(&tcfg);
        let dshape = DrafterShape { offload_layers: parked, ..DrafterShape::from_config(&dcfg, 2048) };
        let last_tap = *dcfg.target_layer_ids.iter().max().unwrap();
        let plan = FitPlan {
            target: &shape,
            last_tap,
            drafter: &dshape,
            rows: 4 * 512 * dcfg.block_size,
            offload_optimizer: offload,
            split_fc,
        };
        needs::<CpuBackend>(&plan, topo)
    }

    const GIB: f64 = (1u64 << 30) as f64;

    /// Each bound stays under the device peak a GPU run measured with those settings (README:
    /// "Measured at the Qwen3.6-27B recipe", "Measured at the Qwen3-8B recipe"), and the one case
    /// that ran out of memory on an 80 GB card (the 27B recipe with device moments: 79.18 GiB on
    /// the H100) is flagged.
    #[test]
    fn bounds_stay_under_measured_peaks_and_flag_the_27b_recipe_on_80_gb() {
        let t = one_device();
        let h100 = 81079.0 / 1024.0;
        // Qwen3.6-27B recipe: H200 (device moments) peaked at 94.50 GiB; H100 with
        // --offload-optimizer at 76.75 GiB.
        let dev = &need("qwen3.6-27b-shape", Some("qwen3.6-27b"), 2, false, &t)[0];
        let off = &need("qwen3.6-27b-shape", Some("qwen3.6-27b"), 2, true, &t)[0];
        let (dp, op) = (dev.peak() as f64 / GIB, off.peak() as f64 / GIB);
        assert!(dp < 94.50 && dp > h100, "27B with device moments: {dp:.2} GiB");
        assert!(op < 76.75, "27B offloaded: {op:.2} GiB");
        assert!((dev.setup() as f64 / GIB) < h100, "the 27B setup fits 80 GB (it did: the run reached step 1)");
        assert_eq!(dev.setup(), off.setup(), "the moments are created on the device either way");
        let moments: u64 = dev.parts.iter().filter(|p| p.what.contains("AdamW")).map(|p| p.bytes).sum();
        assert_eq!(dev.peak() - off.peak(), moments, "offloading takes exactly the moments off the peak");
        assert_eq!(dev.offloadable_at_peak(), moments, "what the warning says the flag saves");
        assert_eq!(off.offloadable_at_peak(), 0);
        // Qwen3-8B recipe: 42.21 GiB (2 parked), 45.21 (none parked), 34.40 (offloaded).
        for (parked, offload, measured) in [(2, false, 42.21), (0, false, 45.21), (2, true, 34.40)] {
            let p = need("qwen3-8b-shape", None, parked, offload, &t)[0].peak() as f64 / GIB;
            assert!(p < measured && p > 0.7 * measured, "8B, {parked} parked, offload {offload}: {p:.2} GiB");
        }
    }

    /// Under split-FC the fc group is created by the drafter rank and then moves beside the
    /// target with its moments, which `--offload-optimizer` leaves there: counted once at setup
    /// and once at the peak, moments included.
    #[test]
    fn split_fc_keeps_the_fc_groups_moments_beside_the_target() {
        let t = one_device();
        let plain = &need_split("qwen3-8b-shape", None, 2, true, false, &t)[0];
        let split = &need_split("qwen3-8b-shape", None, 2, true, true, &t)[0];
        assert_eq!(plain.setup(), split.setup());
        let tcfg = TargetConfig::preset("qwen3-8b-shape").unwrap();
        let fc = 5 * tcfg.hidden_size as u64 * tcfg.hidden_size as u64;
        assert_eq!(split.peak() - plain.peak(), fc * MOMENT_BYTES, "the fc moments stay on the device");
        let on_device = |split_fc| need_split("qwen3-8b-shape", None, 2, false, split_fc, &t)[0].offloadable_at_peak();
        assert_eq!(on_device(false) - on_device(true), fc * MOMENT_BYTES, "the flag cannot move the fc moments");
        let two = Topology { devices: vec![0, 1], targets: vec![0], drafters: vec![1] };
        let split2 = need_split("qwen3-8b-shape", None, 2, true, true, &two);
        assert!(split2[0].peak() > split2[0].setup(), "the fc group arrives at the target's device after setup");
        assert_eq!(split2[0].peak() - split2[0].setup(), fc * (PARAM_BYTES + MOMENT_BYTES));
        assert!(split2[1].parts.iter().all(|p| !p.what.contains("fc") || !p.at_peak));
    }

    /// Every part lands on the device that holds it: the target on its own, the drafter's state
    /// with copies of the embedding and lm_head on the other.
    #[test]
    fn two_devices_split_the_parts() {
        let topo = Topology { devices: vec![0, 1], targets: vec![0], drafters: vec![1] };
        let split = need("qwen3-8b-shape", None, 2, false, &topo);
        let one = &need("qwen3-8b-shape", None, 2, false, &one_device())[0];
        let tcfg = TargetConfig::preset("qwen3-8b-shape").unwrap();
        let copies = 2 * 2 * (tcfg.vocab_size * tcfg.hidden_size) as u64;
        assert_eq!(split[0].parts.len(), 1, "the target's device holds the target only");
        assert_eq!(split[0].peak() + split[1].peak(), one.peak() + copies);
        assert!(split[1].parts.iter().all(|p| !p.what.contains("the target's weights")));
    }
}
