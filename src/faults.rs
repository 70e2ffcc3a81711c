//! Fault injection for the failure tests: one plan, built at the edge (the binary reads
//! `DFLASH_FAULT`; tests fill it directly) and handed to the parts it arms. Nothing in the
//! library reads the environment for it.

use serde::Serialize;

/// Where a run fails on purpose. Steps are 0-based step indices (messages count from 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FaultPlan {
    /// The producer returns an error before running the target of this step.
    pub producer_error_at: Option<u32>,
    /// Publishing this step's first micro-batch fails (as a failed put would).
    pub publish_error_at: Option<u32>,
    /// The consumer (the last drafter rank) panics on receiving this step.
    pub consumer_panic_at: Option<u32>,
    /// The transport's copy of this step's first micro-batch fails, after its slot or buffer was
    /// taken (tests that nothing leaks).
    pub copy_error_at: Option<u32>,
    /// Every checkpoint first waits this long (a slow disk: the target side runs ahead meanwhile).
    pub checkpoint_delay_ms: Option<u64>,
    /// The forced hazard of the NaN suite: the drafter's reads of this step are held back on
    /// the device until the target's next step has allocated and written its buffers, so
    /// memory the drafter still has to read is reused if the allocator ever allows it (it does
    /// only in its test-only unsafe-reuse mode). Meaningful on one GPU with the same-device
    /// transport; a no-op on the CPU.
    pub hold_reads_at: Option<u32>,
    /// A checkpoint save aborts the process after writing its model file into the temporary
    /// folder, before the rename (proves a kill during a save is harmless).
    pub abort_mid_checkpoint: bool,
    /// Trains with the drafter's context off by one against its labels, as a trainer
    /// off-by-one does (DFLASH.md pitfall 1): slot `r` of the block at anchor `a` learns the
    /// token at `a + r + 1`, so its context and anchor are one position behind what it learns
    /// to predict (`session::setup::shift_labels_one_ahead`). Training's accuracy and simulated
    /// acceptance look fine; `eval` shows the collapse: served, every draft is one token ahead
    /// of the one the target verifies. Test-only.
    pub context_off_by_one: bool,
    /// `prepare-data` aborts after appending this 0-based chunk's lines to its partial output,
    /// before recording them (proves a kill there loses and duplicates nothing).
    pub prepare_abort_after_chunk: Option<u64>,
    /// The forced hazard of parked activations (`model::park`); test-only.
    pub park: ParkFault,
    /// The forced hazard of the update beside the target forward
    /// (`DrafterSide::overlap_updates`); test-only.
    pub update: UpdateFault,
}

/// The forced hazard of the AdamW on its own stream (`DrafterSide::overlap_updates`), test-only:
/// each step's update is held back on the device (its stream waits on a flag) until the compute
/// stream releases it. A held update blocks whatever waits for its stream: a host wait for the
/// moments' copies (an update that fails mid-chunk) or the allocator's out-of-memory retry (which
/// frees cached segments, a device-wide wait) would hang under `Held`; the tests reach neither.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum UpdateFault {
    #[default]
    None,
    /// Held, and released by the compute stream just before it waits for the update (after the
    /// next step's first target forward): results must not change.
    Held,
    /// Held, and released only after the next step's drafter forward and backward, with the
    /// compute stream not waiting for it: every step from the second trains on weights one
    /// update behind, and each update reads the next step's gradients instead of its own (and
    /// races with that step's plan), so the run differs, every time.
    Unjoined,
}

/// The forced hazard of parked activations (`model::park`), test-only: every parked copy to the
/// host is held back on the device until the compute stream gives its buffer up. A step that
/// fails between a park and its settle would leave that copy held (and the host waiting for it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum ParkFault {
    #[default]
    None,
    /// Held, and released before the compute stream waits for the copy and frees the buffer, as
    /// parking does: results must not change.
    Held,
    /// Held, and released only after the buffer was freed without that wait: the copy then reads
    /// freed memory (filled with NaN under the allocator's poison-on-free mode), every time.
    HeldUnordered,
}

/// A `DFLASH_FAULT` value the plan does not know.
#[derive(Debug, thiserror::Error)]
#[error(
    "DFLASH_FAULT={0}: expected producer-error@STEP, publish-error@STEP, consumer-panic@STEP, copy-error@STEP, \
     checkpoint-mid-write, context-off-by-one, park-held, park-unordered, update-held, update-unjoined or \
     prepare-abort@CHUNK (STEP, CHUNK: \
     0-based indices)"
)]
pub struct BadFault(pub String);

impl FaultPlan {
    /// Parses the `DFLASH_FAULT` syntax: `<kind>@<step>`, `checkpoint-mid-write` or
    /// `context-off-by-one`.
    pub fn parse(v: &str) -> Result<Self, BadFault> {
        let mut f = FaultPlan::default();
        if v == "checkpoint-mid-write" {
            f.abort_mid_checkpoint = true;
            return Ok(f);
        }
        if v == "context-off-by-one" {
            f.context_off_by_one = true;
            return Ok(f);
        }
        if v == "update-held" || v == "update-unjoined" {
            f.update = if v == "update-held" { UpdateFault::Held } else { UpdateFault::Unjoined };
            return Ok(f);
        }
        if v == "park-held" || v == "park-unordered" {
            f.park = if v == "park-held" { ParkFault::Held } else { ParkFault::HeldUnordered };
            return Ok(f);
        }
        let bad = || BadFault(v.to_string());
        let (kind, step) = v.split_once('@').ok_or_else(bad)?;
        let step: u32 = step.parse().map_err(|_| bad())?;
        match kind {
            "producer-error" => f.producer_error_at = Some(step),
            "publish-error" => f.publish_error_at = Some(step),
            "consumer-panic" => f.consumer_panic_at = Some(step),
            "copy-error" => f.copy_error_at = Some(step),
            "prepare-abort" => f.prepare_abort_after_chunk = Some(u64::from(step)),
            _ => return Err(bad()),
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_and_rejects_the_rest() {
        assert_eq!(FaultPlan::parse("producer-error@3").unwrap().producer_error_at, Some(3));
        assert_eq!(FaultPlan::parse("copy-error@0").unwrap().copy_error_at, Some(0));
        assert!(FaultPlan::parse("checkpoint-mid-write").unwrap().abort_mid_checkpoint);
        assert!(FaultPlan::parse("context-off-by-one").unwrap().context_off_by_one);
        assert_eq!(FaultPlan::parse("park-held").unwrap().park, ParkFault::Held);
        assert_eq!(FaultPlan::parse("park-unordered").unwrap().park, ParkFault::HeldUnordered);
        assert_eq!(FaultPlan::parse("update-held").unwrap().update, UpdateFault::Held);
        assert_eq!(FaultPlan::parse("update-unjoined").unwrap().update, UpdateFault::Unjoined);
        assert_eq!(FaultPlan::parse("prepare-abort@2").unwrap().prepare_abort_after_chunk, Some(2));
        for bad in ["producer-error", "producer-error@x", "nonsense@1", ""] {
            let e = FaultPlan::parse(bad).unwrap_err().to_string();
            assert!(e.contains("DFLASH_FAULT") && e.contains("expected"), "{e}");
        }
    }
}
