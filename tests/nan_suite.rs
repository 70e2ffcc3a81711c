//! The NaN-regression suite (DESIGN.md sections 2 and 5): no amount of asynchrony may change a
//! bit of the training result. For every transport x split-FC x padding x queue depth the async
//! run's losses and final weights equal the fully synchronous run's. The allocator's debug modes
//! prove the suite can see corruption: poison-on-free stays clean, unsafe-reuse does not. Faults
//! at every boundary, the transport's copy included, end the run with a clear error and leave no
//! pinned slot or device block behind.
//!
//! The CPU variants run everywhere (the same pipeline, slot pool and transports, with host
//! memory); the `gpu_` variants run on the GPU machine, those ending `_on_two_gpus` on two GPUs
//! (without a second GPU they fail; scripts/gpu-run.sh skips them by name on a one-GPU machine).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::{final_masters, losses, Scratch};
use dflash_engine::backend::cuda::alloc::Mode;
use dflash_engine::faults::FaultPlan;
use dflash_engine::pipeline::Transport;
use dflash_engine::session::{self, Device, RunOptions};

/// Small enough for seconds per run on the CPU; two micro-batches per step; written into `out`.
fn small(out: PathBuf, device: Device) -> RunOptions {
    {
        let mut ro = RunOptions::tiny_default();
        ro.data.gen_samples = 32;
        ro.data.seq_len = 40;
        ro.train.steps = 6;
        ro.data.batch_size = 3;
        ro.data.grad_accum = 2;
        ro.data.anchors = 6;
        ro.model.block_size = 8;
        ro.output.save_every = 100;
        ro.output.quiet = true;
        // No MFU (the suite compares losses and weights, not rates): measuring its peak is twelve
        // 8192^3 GEMMs, 13 TFLOP, and instrumented GEMMs are what kept sanitizer shards past their
        // windows (sanitize.sh leaves the peak's own test out for that).
        ro.output.mfu_peak = dflash_engine::session::MfuPeak::Off;
        ro.exec.device = device;
        ro.output.out = out;
        ro
    }
}

type Masters = Vec<(String, Vec<u32>)>;

/// `base` as an async run on transport `t`.
fn async_run(base: RunOptions, t: Transport, split: bool, inflight: usize, pad: Option<usize>) -> RunOptions {
    {
        let mut ro = base;
        ro.exec.transport = Some(t);
        ro.exec.split_fc = split;
        ro.exec.max_inflight = inflight;
        ro.data.pad_to_tokens = pad;
        ro
    }
}

/// Runs `o` and requires its losses and final weights to be `want_l` / `want_w` bit for bit, with
/// every pinned slot back.
fn run_matches(o: &RunOptions, want_l: &[u64], want_w: &Masters, what: &str, reference: &str) -> session::RunSummary {
    let got = session::run(o, None).unwrap();
    assert_eq!(losses(&got), want_l, "{what}: losses differ from the {reference} run");
    assert_eq!(&final_masters(&o.output.out), want_w, "{what}: weights differ from the {reference} run");
    assert_eq!(got.stats.slots_in_flight_at_end, 0, "{what}");
    got
}

/// Every (transport, split, pad, inflight) against the synchronous reference of its pad.
/// `DFLASH_NAN_SUITE=quick` (the sanitizer runs, where every kernel is 10-100x slower) keeps
/// every transport and split but only no padding, the deeper queue and 3 steps.
/// `DFLASH_NAN_SUITE_TRANSPORT=same|p2p|host` keeps one transport, so that a sanitizer run can
/// split the suite over processes (scripts/sanitize.sh, SUITE_SPLIT); the names are
/// `Transport::name`'s, and a name matching none of them fails the test.
fn matrix(base: impl Fn(&str) -> RunOptions, transports: &[Transport]) {
    let quick = std::env::var("DFLASH_NAN_SUITE").is_ok_and(|v| v == "quick");
    let only = std::env::var("DFLASH_NAN_SUITE_TRANSPORT").ok().filter(|v| !v.is_empty());
    let transports: Vec<Transport> =
        transports.iter().copied().filter(|t| only.as_deref().is_none_or(|o| o == t.name())).collect();
    assert!(
        !transports.is_empty(),
        "DFLASH_NAN_SUITE_TRANSPORT={} names none of this suite's transports",
        only.unwrap_or_default()
    );
    let pads: &[Option<usize>] = if quick { &[None] } else { &[None, Some(160)] };
    let depths: &[usize] = if quick { &[3] } else { &[1, 3] };
    let mut rows = Vec::new();
    for &pad in pads {
        let steps = if quick { 3 } else { base("steps").train.steps };
        let base = |tag: &str| {
            let mut ro = base(tag);
            ro.train.steps = steps;
            ro
        };
        let reference = {
            let mut ro = base("sync");
            ro.exec.sync = true;
            ro.data.pad_to_tokens = pad;
            ro.exec.drafter_gpus = Vec::new();
            ro
        };
        let want = session::run(&reference, None).unwrap();
        let want_w = final_masters(&reference.output.out);
        assert!(want.history.iter().all(|m| m.loss.is_finite()));
        for &t in &transports {
            for split in [false, true] {
                for &inflight in depths {
                    let o = async_run(base("async"), t, split, inflight, pad);
                    let what = format!("transport {} split-fc {split} pad {pad:?} max-inflight {inflight}", t.name());
                    let got = run_matches(&o, &losses(&want), &want_w, &what, "synchronous");
                    rows.push(format!(
                        "{what}: {} steps bit-identical ({:.1} MB moved)",
                        got.history.len(),
                        got.stats.bytes_moved as f64 / 1e6
                    ));
                }
            }
        }
    }
    for r in &rows {
        eprintln!("nan-suite  {r}");
    }
    eprintln!("nan-suite  {} combinations, all bit-identical to the synchronous run", rows.len());
}

#[test]
fn cpu_async_matches_sync_for_every_transport_split_pad_and_depth() {
    let scratch = Scratch::new("nan-cpu_async_matches_sync_for_every_transport_split_pad_and_depth");
    matrix(|tag| small(scratch.fresh(tag), Device::Cpu), &[Transport::Same, Transport::Peer, Transport::Host]);
}

/// A copy that fails after taking its slot (host) or its destination buffer (p2p), and the other
/// faults, end the run with their error within seconds and nothing left behind.
fn faults(device: Device, drafter_gpus: Vec<usize>, transports: &[Transport]) {
    let scratch = Scratch::new("nan-faults");
    faults_on(
        |tag| {
            let mut ro = small(scratch.fresh(tag), device);
            ro.exec.drafter_gpus = drafter_gpus.clone();
            ro
        },
        transports,
    );
}

fn faults_on(base: impl Fn(&str) -> RunOptions, transports: &[Transport]) {
    let targets = base("shape").exec.target_gpus.len();
    for &t in transports {
        let cases: [(FaultPlan, &str); 4] = [
            (FaultPlan { copy_error_at: Some(2), ..Default::default() }, "copy failed"),
            (FaultPlan { producer_error_at: Some(3), ..Default::default() }, "producer) failed at step 4"),
            (FaultPlan { publish_error_at: Some(2), ..Default::default() }, "could not publish step 3"),
            (FaultPlan { consumer_panic_at: Some(3), ..Default::default() }, "panicked at step 4"),
        ];
        for (f, want) in cases {
            let splits: &[bool] = if targets > 1 { &[false] } else { &[false, true] };
            for &split in splits {
                let t0 = Instant::now();
                let o = {
                    let mut ro = base("fault");
                    ro.exec.faults = f;
                    ro.exec.transport = Some(t);
                    ro.exec.split_fc = split;
                    ro
                };
                let err = session::run(&o, None).expect_err("the fault must fail the run");
                let msg = format!("{err:#}");
                let what = format!("transport {} split {split} fault {f:?}", t.name());
                assert!(msg.contains(want), "{what}: {msg}");
                assert!(msg.contains("no leaked slot or block"), "{what}: {msg}");
                assert!(t0.elapsed() < Duration::from_secs(60), "{what}: took {:?}", t0.elapsed());
                eprintln!("fault      {what}: {:.1} s, {msg}", t0.elapsed().as_secs_f64());
            }
        }
    }
}

#[test]
fn cpu_faults_end_the_run_cleanly_on_every_transport() {
    faults(Device::Cpu, Vec::new(), &[Transport::Same, Transport::Peer, Transport::Host]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_async_matches_sync_on_one_gpu() {
    let scratch = Scratch::new("nan-gpu_async_matches_sync_on_one_gpu");
    matrix(|tag| small(scratch.fresh(tag), Device::Cuda), &[Transport::Same, Transport::Peer, Transport::Host]);
}

/// The same matrix with the Qwen3.5/3.6 hybrid target (Gated DeltaNet and gated attention
/// kernels on the target side).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_async_matches_sync_on_one_gpu_with_the_hybrid_target() {
    let scratch = Scratch::new("nan-gpu_async_matches_sync_on_one_gpu_with_the_hybrid_target");
    matrix(
        |tag| {
            let mut ro = small(scratch.fresh(tag), Device::Cuda);
            ro.model.target = "qwen3.5-tiny".into();
            ro
        },
        &[Transport::Same, Transport::Peer, Transport::Host],
    );
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_async_matches_sync_on_two_gpus() {
    let scratch = Scratch::new("nan-gpu_async_matches_sync_on_two_gpus");
    matrix(
        |tag| {
            let mut ro = small(scratch.fresh(tag), Device::Cuda);
            ro.exec.drafter_gpus = vec![1];
            ro
        },
        &[Transport::Peer, Transport::Host],
    );
}

/// Several target devices and data-parallel drafter ranks: every async run equals the lockstep
/// run of its topology bit for bit (losses and final weights); with one drafter rank the lockstep
/// run also equals the one-device synchronous run bit for bit, with several it tracks it (the
/// gradient sum's association differs).
fn topology_matrix(base: impl Fn(&str) -> RunOptions, transports: &[Transport], splits: &[bool]) {
    let quick = std::env::var("DFLASH_NAN_SUITE").is_ok_and(|v| v == "quick");
    let b = base("shape");
    let (targets, drafters) = (b.exec.target_gpus.clone(), b.exec.drafter_gpus.clone());
    let pads: &[Option<usize>] = if quick { &[None] } else { &[None, Some(160)] };
    let depths: &[usize] = if quick { &[3] } else { &[1, 3] };
    let steps = if quick { 3 } else { b.train.steps };
    let base = |tag: &str| {
        let mut ro = base(tag);
        ro.train.steps = steps;
        ro
    };
    let mut rows = Vec::new();
    for &pad in pads {
        let one = {
            let mut ro = base("one-device-sync");
            ro.exec.sync = true;
            ro.data.pad_to_tokens = pad;
            ro.exec.target_gpus = vec![targets[0]];
            ro.exec.drafter_gpus = Vec::new();
            ro
        };
        let one_r = session::run(&one, None).unwrap();
        let one_l = losses(&one_r);
        for &split in splits {
            let lock = {
                let mut ro = base("lockstep");
                ro.exec.sync = true;
                ro.exec.split_fc = split;
                ro.data.pad_to_tokens = pad;
                ro
            };
            let want = session::run(&lock, None).unwrap();
            let want_w = final_masters(&lock.output.out);
            let want_l = losses(&want);
            let values = |r: &session::RunSummary| r.history.iter().map(|m| m.loss).collect::<Vec<f64>>();
            assert!(values(&want).iter().all(|l| l.is_finite()));
            let what = format!("targets {targets:?} drafters {drafters:?} split-fc {split} pad {pad:?}");
            if drafters.len() == 1 {
                assert_eq!(want_l, one_l, "{what}: lockstep differs from the one-device synchronous run");
                rows.push(format!("{what}: lockstep == one-device sync, bit-identical"));
            } else {
                let worst =
                    values(&want).iter().zip(values(&one_r)).map(|(a, b)| ((a - b) / b).abs()).fold(0.0, f64::max);
                assert!(worst < 1e-3, "{what}: lockstep vs one-device sync: relative loss difference {worst:e}");
                rows.push(format!(
                    "{what}: lockstep vs one-device sync: max relative loss difference {worst:.2e}{}",
                    if worst == 0.0 { " (bit-identical)" } else { "" }
                ));
            }
            for &t in transports {
                for &inflight in depths {
                    let o = async_run(base("async"), t, split, inflight, pad);
                    let what = format!("{what} transport {} max-inflight {inflight}", t.name());
                    let got = run_matches(&o, &want_l, &want_w, &what, "lockstep");
                    assert_eq!((got.stats.target_ranks, got.stats.drafter_ranks), (targets.len(), drafters.len()));
                    rows.push(format!(
                        "{what}: {} steps bit-identical to lockstep ({:.1} MB moved, {} slot waits, mean queue depth {:.2})",
                        got.history.len(),
                        got.stats.bytes_moved as f64 / 1e6,
                        got.stats.slot_waits,
                        got.stats.mean_queue_depth()
                    ));
                }
            }
        }
    }
    for r in &rows {
        eprintln!("topology   {r}");
    }
}

/// Data parallel over two drafter devices, the target sharing the first.
fn data_parallel_matches_lockstep(device: Device) {
    let scratch = Scratch::new("nan-data_parallel_matches_lockstep");
    topology_matrix(
        |tag| {
            let mut ro = small(scratch.fresh(tag), device);
            ro.exec.target_gpus = vec![0];
            ro.exec.drafter_gpus = vec![0, 1];
            ro
        },
        &[Transport::Peer, Transport::Host],
        &[false, true],
    );
}

/// Two target devices taking steps in turn, one drafter device: also bit-identical to the
/// one-device synchronous run.
fn round_robin_targets_match_sync(device: Device, drafter: usize) {
    let scratch = Scratch::new("nan-round_robin_targets_match_sync");
    topology_matrix(
        |tag| {
            let mut ro = small(scratch.fresh(tag), device);
            ro.exec.target_gpus = vec![0, 1];
            ro.exec.drafter_gpus = vec![drafter];
            ro
        },
        &[Transport::Peer, Transport::Host],
        &[false],
    );
}

#[test]
fn cpu_data_parallel_drafter_matches_lockstep() {
    data_parallel_matches_lockstep(Device::Cpu);
}

#[test]
fn cpu_round_robin_targets_match_sync() {
    round_robin_targets_match_sync(Device::Cpu, 2);
}

/// The eight-GPU topology (five targets feeding three drafter ranks) on eight CPU backends,
/// through the real queues, links and pinned-slot pools: async == lockstep, bit for bit.
#[test]
fn cpu_five_targets_three_drafters_match_lockstep() {
    let scratch = Scratch::new("nan-cpu_five_targets_three_drafters_match_lockstep");
    topology_matrix(
        |tag| {
            let mut ro = small(scratch.fresh(tag), Device::Cpu);
            ro.exec.target_gpus = vec![0, 1, 2, 3, 4];
            ro.exec.drafter_gpus = vec![5, 6, 7];
            ro.data.grad_accum = 3;
            ro.data.batch_size = 2;
            ro.train.steps = 7;
            ro
        },
        &[Transport::Host, Transport::Peer],
        &[false],
    );
}

/// Faults with several targets and drafter ranks: the failing thread's error, no hang, no leak
/// (the consumer panic is injected in the last rank, a spawned thread).
fn faults_with_two_targets_and_two_ranks(device: Device, drafters: Vec<usize>) {
    let scratch = Scratch::new("nan-faults_with_two_targets_and_two_ranks");
    faults_on(
        |tag| {
            let mut ro = small(scratch.fresh(tag), device);
            ro.exec.target_gpus = vec![0, 1];
            ro.exec.drafter_gpus = drafters.clone();
            ro
        },
        &[Transport::Host, Transport::Peer],
    );
}

#[test]
fn cpu_faults_with_several_targets_and_ranks() {
    faults_with_two_targets_and_two_ranks(Device::Cpu, vec![2, 3]);
}

/// Split-FC with two drafter ranks: a rank's panic (the last rank) or error must be reported
/// as itself, not as the other rank's closed slot pool or aborted all-reduce.
#[test]
fn cpu_faults_with_two_drafter_ranks_and_split_fc() {
    let scratch = Scratch::new("nan-cpu_faults_with_two_drafter_ranks_and_split_fc");
    faults_on(
        |tag| {
            let mut ro = small(scratch.fresh(tag), Device::Cpu);
            ro.exec.target_gpus = vec![0];
            ro.exec.drafter_gpus = vec![0, 1];
            ro
        },
        &[Transport::Host, Transport::Peer],
    );
}

#[test]
fn topology_errors_say_what_to_change() {
    let scratch = Scratch::new("nan-topology_errors_say_what_to_change");
    let run = |o: RunOptions| format!("{:#}", session::run(&o, None).expect_err("must be refused"));
    let e = run({
        let mut ro = small(scratch.fresh("bad-accum"), Device::Cpu);
        ro.exec.drafter_gpus = vec![0, 1, 2];
        ro
    });
    assert!(e.contains("--grad-accum 2") && e.contains("multiple of 3"), "{e}");
    let e = run({
        let mut ro = small(scratch.fresh("bad-split"), Device::Cpu);
        ro.exec.target_gpus = vec![0, 1];
        ro.exec.split_fc = true;
        ro
    });
    assert!(e.contains("needs one target GPU"), "{e}");
    let e = run({
        let mut ro = small(scratch.fresh("bad-dup"), Device::Cpu);
        ro.exec.drafter_gpus = vec![1, 1];
        ro
    });
    assert!(e.contains("lists a device twice"), "{e}");
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_data_parallel_drafter_matches_lockstep_on_two_gpus() {
    data_parallel_matches_lockstep(Device::Cuda);
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_round_robin_targets_match_sync_on_two_gpus() {
    round_robin_targets_match_sync(Device::Cuda, 1);
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_faults_with_two_targets_and_two_ranks_on_two_gpus() {
    faults_with_two_targets_and_two_ranks(Device::Cuda, vec![0, 1]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_faults_end_the_run_cleanly() {
    faults(Device::Cuda, Vec::new(), &[Transport::Same, Transport::Peer, Transport::Host]);
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_faults_end_the_run_cleanly_on_two_gpus() {
    faults(Device::Cuda, vec![1], &[Transport::Peer, Transport::Host]);
}

/// A configuration whose GPU kernels run long enough that a freed buffer's reuse can overtake
/// the stream still reading it: the "small" preset, 512-token sequences, random-token data (in
/// `dir`, the run in `dir`/out).
fn busy(dir: PathBuf) -> RunOptions {
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("data.jsonl");
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut text = String::new();
    for _ in 0..64 {
        let ids: Vec<String> = (0..512)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 4000).to_string()
            })
            .collect();
        let mask: Vec<&str> = (0..512).map(|i| if i < 32 { "0" } else { "1" }).collect();
        text += &format!("{{\"input_ids\": [{}], \"loss_mask\": [{}]}}\n", ids.join(", "), mask.join(", "));
    }
    std::fs::write(&data, text).unwrap();
    {
        let mut ro = RunOptions::tiny_default();
        ro.model.target = "small".into();
        ro.data.path = Some(data);
        ro.data.seq_len = 512;
        ro.data.batch_size = 4;
        ro.data.grad_accum = 3;
        ro.data.anchors = 32;
        ro.model.block_size = 16;
        ro.train.steps = 8;
        ro.output.save_every = 100;
        ro.output.quiet = true;
        ro.exec.device = Device::Cuda;
        ro.output.out = dir.join("out");
        ro
    }
}

/// Parking has teeth too (`FaultPlan::park`): every parked copy to the host is held back on the
/// device until the compute stream gives its buffer up. Released before the compute stream waits
/// for the copy and frees the buffer (what parking does), nothing changes; released only after a
/// free without that wait, the copy reads memory the allocator filled with NaN (poison-on-free),
/// and the run differs, every time.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_parking_without_its_wait_is_detected() {
    let scratch = Scratch::new("nan-gpu_parking_without_its_wait_is_detected");
    use dflash_engine::faults::ParkFault;
    let run = |tag: &str, park| {
        let mut ro = busy(scratch.fresh(tag));
        ro.train.steps = 4;
        ro.exec.sync = true;
        ro.exec.alloc_mode = Some(Mode::PoisonOnFree);
        ro.exec.faults = FaultPlan { park, ..Default::default() };
        session::run(&ro, None).map(|r| losses(&r))
    };
    let want = run("park-ref", ParkFault::None).unwrap();
    assert!(want.iter().all(|&l| f64::from_bits(l).is_finite()), "{want:?}");
    assert_eq!(run("park-held", ParkFault::Held).unwrap(), want, "held copies, released in order, must change nothing");
    // NaN gate|up products give NaN gradients: the step is skipped, so the losses after it differ.
    let bad = run("park-unordered", ParkFault::HeldUnordered).unwrap();
    assert_ne!(bad, want, "a parked buffer freed before its copy must corrupt the run");
}

/// The synchronous loop runs each step's AdamW on a stream of its own beside the next step's
/// target forward (`DrafterSide::overlap_updates`), with the moments on the device and
/// offloaded. Against the update run in order after the step (`--serial-update`): the same
/// losses and weights, bit for bit, under poison-on-free; the same with every update held back
/// on the device until the compute stream reaches its wait (`UpdateFault::Held`). And the wait
/// has teeth: released only after the next step's drafter work, with no wait
/// (`UpdateFault::Unjoined`), the run differs, every time.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_update_beside_the_target_forward_is_exact_and_its_wait_is_needed() {
    use dflash_engine::faults::UpdateFault;
    let scratch = Scratch::new("nan-gpu_update_beside_the_target_forward");
    let run = |tag: &str, update, serial: bool, offload: bool| {
        let mut ro = busy(scratch.fresh(tag));
        ro.train.steps = 4;
        ro.exec.sync = true;
        ro.exec.serial_update = serial;
        ro.exec.offload_optimizer = offload;
        ro.exec.alloc_mode = Some(Mode::PoisonOnFree);
        ro.exec.faults = FaultPlan { update, ..Default::default() };
        let r = session::run(&ro, None).unwrap();
        (losses(&r), final_masters(&ro.output.out))
    };
    let want = run("serial", UpdateFault::None, true, false);
    assert!(want.0.iter().all(|&l| f64::from_bits(l).is_finite()), "{:?}", want.0);
    for offload in [false, true] {
        assert!(run("overlap", UpdateFault::None, false, offload) == want, "overlapped update, offload {offload}");
        assert!(run("held", UpdateFault::Held, false, offload) == want, "held update, offload {offload}");
        let bad = run("unjoined", UpdateFault::Unjoined, false, offload);
        assert_ne!(bad.0, want.0, "an update not waited for must change the run (offload {offload})");
        eprintln!(
            "update     offload {offload}: overlapped and held bit-identical to the serial update; unjoined differs"
        );
    }
}

/// Poison-on-free (every freed block filled with NaN bytes when it becomes reusable, and every new
/// segment when it is reserved) changes nothing: no buffer is read after its memory was given
/// back, the AdamW moments' staging buffers (`--offload-optimizer`) included, and nothing reads
/// memory no kernel, copy or GEMM wrote (what compute-sanitizer's initcheck cannot tell where
/// cuBLASLt wrote it). Also at the suite's shape with the tiny dense and hybrid targets, where
/// initcheck reported reads of GEMM outputs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_poison_on_free_runs_clean() {
    let scratch = Scratch::new("nan-gpu_poison_on_free_runs_clean");
    let want = session::run(
        &{
            let mut ro = busy(scratch.fresh("poison-ref"));
            ro.exec.sync = true;
            ro
        },
        None,
    )
    .unwrap();
    for t in [Transport::Same, Transport::Peer, Transport::Host] {
        for inflight in [1, 3] {
            let o = {
                let mut ro = busy(scratch.fresh("poison"));
                ro.exec.alloc_mode = Some(Mode::PoisonOnFree);
                ro.exec.transport = Some(t);
                ro.exec.max_inflight = inflight;
                ro
            };
            let got = session::run(&o, None).unwrap();
            assert_eq!(losses(&got), losses(&want), "poison-on-free, transport {} inflight {inflight}", t.name());
            eprintln!("poison     transport {} inflight {inflight}: bit-identical, no NaN", t.name());
        }
    }
    // The AdamW moments in host memory (`--offload-optimizer`): each chunk's staging buffers go
    // back to the compute stream's pool (and are poisoned there) only after their copies.
    let o = {
        let mut ro = busy(scratch.fresh("poison-offload"));
        ro.exec.alloc_mode = Some(Mode::PoisonOnFree);
        ro.exec.offload_optimizer = true;
        ro
    };
    assert_eq!(losses(&session::run(&o, None).unwrap()), losses(&want), "poison-on-free, moments offloaded");
    eprintln!("poison     moments offloaded: bit-identical, no NaN");
    for target in ["tiny", "qwen3.5-tiny"] {
        let base = |tag: &str| {
            let mut ro = small(scratch.fresh(&format!("{tag}-{target}")), Device::Cuda);
            ro.model.target = target.into();
            ro
        };
        let want = session::run(
            &{
                let mut ro = base("ref");
                ro.exec.sync = true;
                ro
            },
            None,
        )
        .unwrap();
        assert!(want.history.iter().all(|m| m.loss.is_finite()));
        for sync in [true, false] {
            let mut ro = base("poison");
            ro.exec.alloc_mode = Some(Mode::PoisonOnFree);
            ro.exec.sync = sync;
            assert_eq!(
                losses(&session::run(&ro, None).unwrap()),
                losses(&want),
                "poison-on-free, {target}, sync {sync}"
            );
            eprintln!("poison     {target} target, sync {sync}: bit-identical, no NaN");
        }
    }
}

/// The suite has teeth, every time: the drafter's reads of step 3 are held back on the device
/// (`FaultPlan::hold_reads_at`) until the target's step 4 has allocated and written its buffers.
/// With the allocator's cross-stream deferral switched off (unsafe-reuse) the memory the drafter
/// still has to read is handed to the target, and step 3's loss changes in every configuration;
/// in the normal mode the same forced overlap changes nothing (bit-identical to the synchronous
/// run). The batch is handed over without a copy only on one device (transport same).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_unsafe_reuse_is_detected_every_time() {
    let scratch = Scratch::new("nan-gpu_unsafe_reuse_is_detected_every_time");
    const HELD: u32 = 3;
    let teeth = |tag: &str| {
        let mut ro = busy(scratch.fresh(tag));
        ro.train.steps = 6;
        ro
    };
    let want = losses(
        &session::run(
            &{
                let mut ro = teeth("teeth-ref");
                ro.exec.sync = true;
                ro
            },
            None,
        )
        .unwrap(),
    );
    for inflight in [1, 3] {
        let base = {
            let mut ro = teeth("teeth");
            ro.exec.transport = Some(Transport::Same);
            ro.exec.max_inflight = inflight;
            ro.exec.faults = FaultPlan { hold_reads_at: Some(HELD), ..Default::default() };
            ro
        };
        let control = session::run(&base, None).unwrap();
        assert_eq!(losses(&control), want, "normal mode with held reads must match: inflight {inflight}");
        let bad = session::run(
            &{
                let mut ro = base;
                ro.exec.alloc_mode = Some(Mode::UnsafeReuse);
                ro.output.out = scratch.fresh("teeth-bad");
                ro
            },
            None,
        );
        let how = match &bad {
            Ok(r) => {
                let got = losses(r);
                // The held step is corrupted every time; with a deeper queue the target also runs
                // ahead into memory the drafter still reads without being held, and an earlier
                // step may already differ (a race the hold did not have to force).
                let first = got.iter().zip(&want).position(|(a, b)| a != b);
                assert!(
                    first.is_some_and(|i| i <= HELD as usize),
                    "unsafe-reuse must corrupt step {} at the latest: inflight {inflight}, first differing step {:?}",
                    HELD + 1,
                    first.map(|i| i + 1)
                );
                assert_ne!(
                    got[HELD as usize], want[HELD as usize],
                    "unsafe-reuse must corrupt the held step: inflight {inflight}"
                );
                let first = first.unwrap_or(HELD as usize);
                format!(
                    "first corrupted step {} (held: {}), step {} loss {} instead of {}",
                    first + 1,
                    HELD + 1,
                    HELD + 1,
                    r.history[HELD as usize].loss,
                    f64::from_bits(want[HELD as usize])
                )
            }
            Err(e) => format!("run failed: {e:#}"),
        };
        eprintln!("teeth      inflight {inflight}: unsafe-reuse with held reads: {how}; normal mode bit-identical");
    }
}

/// The held-reads hook's host protocol (the target waits for the held batch to be dropped, the
/// drafter waits for the target's signal) neither deadlocks nor changes a result.
#[test]
fn cpu_held_reads_change_nothing() {
    let scratch = Scratch::new("nan-cpu_held_reads_change_nothing");
    let o = small(scratch.fresh("held"), Device::Cpu);
    let want = losses(
        &session::run(
            &{
                let mut ro = o.clone();
                ro.exec.sync = true;
                ro
            },
            None,
        )
        .unwrap(),
    );
    let mut held = o;
    held.output.out = scratch.fresh("held-async");
    held.exec.transport = Some(Transport::Same);
    held.exec.faults = FaultPlan { hold_reads_at: Some(1), ..Default::default() };
    assert_eq!(losses(&session::run(&held, None).unwrap()), want);
}

/// Split-FC (exact mode) on the GPU over 50 steps: losses and final weights bit-identical to the
/// unsplit pipeline, with and without padding, for each drafter placement given.
fn split_fc_is_exact_for_50_steps(placements: &[Vec<usize>]) {
    let scratch = Scratch::new("nan-split_fc_is_exact_for_50_steps");
    for drafters in placements {
        for pad in [None, Some(160)] {
            let base = {
                let mut ro = small(scratch.fresh("split50-unsplit"), Device::Cuda);
                ro.train.steps = 50;
                ro.data.pad_to_tokens = pad;
                ro.exec.drafter_gpus = drafters.clone();
                ro
            };
            let a = session::run(&base, None).unwrap();
            let split = {
                let mut ro = base.clone();
                ro.exec.split_fc = true;
                ro.output.out = scratch.fresh("split50");
                ro
            };
            let b = session::run(&split, None).unwrap();
            let what = format!("drafter GPUs {drafters:?} pad {pad:?}");
            assert_eq!(a.history.len(), 50, "{what}");
            assert_eq!(losses(&a), losses(&b), "{what}: split-FC losses differ");
            assert_eq!(
                final_masters(&base.output.out),
                final_masters(&split.output.out),
                "{what}: split-FC weights differ"
            );
            eprintln!(
                "split-fc   {what}: 50 steps bit-identical to unsplit (loss {:.4} -> {:.4}), transport {}",
                a.history[0].loss, a.history[49].loss, b.stats.transport
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_split_fc_is_exact_for_50_steps() {
    split_fc_is_exact_for_50_steps(&[Vec::new()]);
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_split_fc_is_exact_for_50_steps_on_two_gpus() {
    split_fc_is_exact_for_50_steps(&[vec![1], vec![0, 1]]);
}
