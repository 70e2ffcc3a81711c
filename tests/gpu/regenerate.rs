//! `prepare-data --regenerate` on CUDA: the batched decoding loop over one KV cache (prompts of
//! different lengths, a second turn re-using the cache) writes exactly the greedy answers of a
//! batch-1 decode from scratch on the same GPU, turn by turn.

use super::gpu;

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_regenerate_batched_equals_batch_one_greedy() {
    crate::prepare::check_regenerate(&gpu(), "gpu-regen");
}
