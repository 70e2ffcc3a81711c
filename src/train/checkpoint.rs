//! Host-level checkpoints of the drafter and its optimizer: written so that a crash at any
//! instant leaves the previous checkpoint intact, read back bit-exactly for `--resume`.
//!
//! Layout of a run folder:
//! ```text
//! run/
//!   latest                      text: the name of the newest complete checkpoint folder
//!   step-00000100/
//!     model.safetensors         the drafter in bf16 (round-to-nearest-even of the masters),
//!                               public DFlash names (fc.weight, layers.0.self_attn.q_proj.weight, ...)
//!     config.json               the drafter config, as the caller gave it
//!     optimizer.safetensors     f32 master.<name>, exp_avg.<name>, exp_avg_sq.<name>
//!     trainer_state.json        TrainerState: completed steps, seed, run fingerprint, extra
//!   step-00000200/ ...
//! ```
//!
//! Protocol of [`save`]: every file goes into `run/.step-00000200.tmp-<pid>` (each fsynced), the
//! folder is renamed to `step-00000200` and `run` fsynced, then `latest` is replaced atomically
//! (temp file, fsync, rename, fsync). So a folder named `step-*` is always complete, `latest`
//! always names a complete folder, and a crash only leaves a hidden `.step-*` folder that the
//! next successful save deletes. One writer per run folder.
//!
//! Fault injection: with `FaultPlan::abort_mid_checkpoint` ([`save_with`]) the save calls
//! `std::process::abort()` after writing model.safetensors into the temp folder and before the
//! rename, which is how a test proves that a kill during a save is harmless.
//!
//! [`gather`] and [`restore`] move a drafter's trained state between the device and these host
//! tensors. [`load_init`] and [`apply_init`] are the warm start (`run --init-from`): weights only,
//! from one of these folders or from a published drafter (config.json + model.safetensors).

use crate::faults::FaultPlan;
use crate::weights::{self, TensorStore, WeightsError};
use half::bf16;
use rayon::prelude::*;
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use crate::backend::{Backend, BackendError};
use crate::model::drafter::ParamGroup;
use crate::train::step::DrafterSide;

pub const MODEL_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";
/// The pointer file: the folder name of the newest complete checkpoint, one line.
pub const LATEST_FILE: &str = "latest";

/// Prefixes of the three optimizer tensors of each model tensor in optimizer.safetensors.
const MASTER: &str = "master.";
const EXP_AVG: &str = "exp_avg.";
const EXP_AVG_SQ: &str = "exp_avg_sq.";

/// Where the training run stands; trainer_state.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Completed optimizer steps (the next step to run has this 0-based index).
    pub step: u32,
    pub seed: u64,
    /// Identifies the run's settings (data, config, hyper-parameters), so that a resume with
    /// different settings can be refused by the caller (see `session::options::Fingerprint`).
    pub run_fingerprint: serde_json::Value,
    /// Anything else the trainer wants back (metrics, schedule details); `null` if absent.
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// One trained tensor with its AdamW state, all f32 and all of `shape`'s element count.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorState {
    pub name: String,
    pub shape: Vec<usize>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

/// A checkpoint read back by [`load`] or [`load_latest`].
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The checkpoint folder that was read.
    pub dir: PathBuf,
    pub state: TrainerState,
    pub config_json: String,
    /// Sorted by name (not in the order given to [`save`]); match them by name, e.g. with
    /// [`Loaded::tensor`].
    pub tensors: Vec<TensorState>,
}

impl Loaded {
    /// The tensor called `name`, checked to have `shape`: the error says which checkpoint
    /// does not fit the drafter being trained.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<&TensorState, CheckpointError> {
        let path = self.dir.join(OPTIMIZER_FILE);
        let t = self
            .tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .map(|i| &self.tensors[i])
            .map_err(|_| CheckpointError::MissingTensor { path: path.clone(), name: format!("{MASTER}{name}") })?;
        if t.shape != shape {
            return Err(CheckpointError::ShapeMismatch {
                path,
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
                expected_from: "the drafter being trained (is this checkpoint from another drafter config?)",
            });
        }
        Ok(t)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot {op} {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {}: {reason}", .path.display())]
    Write { path: PathBuf, reason: String },
    #[error("{} is missing: {} is not a complete checkpoint", .path.display(), fmt_parent(.path))]
    MissingFile { path: PathBuf },
    // `source` names the file (`path`) already.
    #[error(
        "damaged checkpoint: {source}. Resume from another checkpoint (load a `step-*` folder \
         explicitly) or delete {}",
        fmt_parent(.path)
    )]
    Unreadable {
        path: PathBuf,
        #[source]
        source: WeightsError,
    },
    #[error("{} is damaged: {reason}", .path.display())]
    BadState { path: PathBuf, reason: String },
    #[error("{}: trainer_state.json says step {state_step} but the folder name says step {folder_step}", .path.display())]
    StepMismatch { path: PathBuf, folder_step: u32, state_step: u32 },
    #[error("tensor `{name}` is missing from {}", .path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{} holds an unexpected tensor `{name}` (damaged, or written by another tool)", .path.display())]
    UnexpectedTensor { path: PathBuf, name: String },
    #[error(
        "tensor `{name}` in {} has shape {found:?}, but {expected_from} has {expected:?}",
        .path.display()
    )]
    ShapeMismatch { path: PathBuf, name: String, expected: Vec<usize>, found: Vec<usize>, expected_from: &'static str },
    #[error("tensor `{name}` in {} is {found}, expected {expected}", .path.display())]
    WrongDtype { path: PathBuf, name: String, expected: Dtype, found: Dtype },
    #[error(
        "{} and {} disagree: `{name}` element {index} is bf16 0x{stored:04x} in the model, but \
         its f32 master rounds to 0x{expected:04x}; one of them is damaged, resume from another \
         checkpoint",
        .model.display(), .optimizer.display()
    )]
    ModelDisagrees { model: PathBuf, optimizer: PathBuf, name: String, index: usize, stored: u16, expected: u16 },
    #[error(
        "{} holds {content:?}, which is not the name of a checkpoint folder beside it; fix or \
         delete it",
        .path.display()
    )]
    BadLatest { path: PathBuf, content: String },
    #[error(
        "{} points to {}, which does not exist; point it at an existing step-* folder, or \
         delete it to resume from the newest one",
        .latest.display(), .target.display()
    )]
    LatestDangling { latest: PathBuf, target: PathBuf },
    #[error("{} is not a checkpoint folder (it does not exist)", .path.display())]
    MissingCheckpoint { path: PathBuf },
    #[error("invalid checkpoint to save: {0}")]
    InvalidInput(String),
    #[error(
        "--init-from {}: no drafter checkpoint there (a folder with config.json and \
         model.safetensors, or a run's --out holding step-* folders)",
        .path.display()
    )]
    NoInitCheckpoint { path: PathBuf },
    #[error("--init-from {}: {source}", .path.display())]
    InitConfig {
        path: PathBuf,
        #[source]
        source: crate::config::ConfigError,
    },
    #[error(
        "--init-from {}: the checkpoint's drafter differs from this run's: {field} is {theirs} \
         in its config.json but {ours} here; {}",
        .path.display(),
        if *from_target {
            "the drafter takes it from its target, so the checkpoint was trained against another target: give \
             the --target it was trained against"
        } else {
            "give the same --drafter-config (or drafter flags) as the checkpoint was trained with"
        }
    )]
    InitMismatch { path: PathBuf, field: &'static str, theirs: String, ours: String, from_target: bool },
}

fn fmt_parent(path: &Path) -> String {
    path.parent().map_or_else(|| ".".to_string(), |p| p.display().to_string())
}

type Result<T, E = CheckpointError> = std::result::Result<T, E>;

fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> CheckpointError + 'a {
    move |source| CheckpointError::Io { path: path.to_path_buf(), op, source }
}

/// `step-00000100`: zero-padded so that listings sort by step up to 10^8 steps (parsing never
/// relies on the padding).
pub fn step_dir_name(step: u32) -> String {
    format!("step-{step:08}")
}

/// The step of a folder named exactly as [`step_dir_name`] makes it, else `None`.
fn parse_step_dir_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("step-")?;
    let step = if digits.bytes().all(|b| b.is_ascii_digit()) { digits.parse().ok()? } else { return None };
    (step_dir_name(step) == name).then_some(step)
}

// ---------------------------------------------------------------------------------------------
// Saving
// ---------------------------------------------------------------------------------------------

/// Writes the checkpoint of `state.step` into `dir` (created if needed) with the protocol in
/// the module doc, points `latest` at it, then deletes `step-*` folders beyond the newest
/// `keep_last` among those up to this step (0 keeps all; folders of later steps, left by a run
/// that was resumed from an earlier checkpoint, are not touched until overwritten) and any
/// leftover hidden `.step-*` folders. Saving a step that already has a folder replaces it.
/// Returns the checkpoint folder. An error from the clean-up after publishing (e.g. no right
/// to delete an old folder) still leaves the new checkpoint complete and named by `latest`.
pub fn save(
    dir: impl AsRef<Path>,
    state: &TrainerState,
    config_json: &str,
    tensors: &[TensorState],
    keep_last: usize,
) -> Result<PathBuf> {
    save_with(dir, state, config_json, tensors, keep_last, &FaultPlan::default())
}

/// [`save`] with a fault plan (failure tests).
pub fn save_with(
    dir: impl AsRef<Path>,
    state: &TrainerState,
    config_json: &str,
    tensors: &[TensorState],
    keep_last: usize,
    faults: &FaultPlan,
) -> Result<PathBuf> {
    let dir = dir.as_ref();
    check_tensors(tensors)?;
    std::fs::create_dir_all(dir).map_err(io(dir, "create the checkpoint folder"))?;
    let name = step_dir_name(state.step);
    let pid = std::process::id();
    let mut tmp = dir.join(format!(".{name}.tmp-{pid}"));
    // An earlier process with our pid (containers reuse pids) may have left this folder. It is
    // incomplete, unless that process died while replacing this very step and `latest` names it
    // (see `publish`): then it is the checkpoint we resumed from, and we write beside it.
    if read_latest(dir).ok().flatten().is_some_and(|l| dir.join(l) == tmp) {
        tmp = dir.join(format!(".{name}.tmp-{pid}-next"));
    }
    remove_dir_if_exists(&tmp)?;
    std::fs::create_dir(&tmp).map_err(io(&tmp, "create"))?;
    let written = write_contents(&tmp, state, config_json, tensors, faults);
    let published = written.and_then(|()| publish(dir, &tmp, &name));
    if let Err(e) = published {
        // Best effort (the next save cleans up otherwise), and never the folder `latest` names:
        // a failure while replacing the current step leaves `latest` on the temp folder.
        let tmp_name = tmp.file_name().map(|n| n.to_string_lossy().into_owned());
        if read_latest(dir).ok().flatten() != tmp_name {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        return Err(e);
    }
    prune(dir, state.step, keep_last)?;
    remove_stale(dir)?;
    Ok(dir.join(name))
}

fn check_tensors(tensors: &[TensorState]) -> Result<()> {
    if tensors.is_empty() {
        return Err(CheckpointError::InvalidInput("no tensors".into()));
    }
    let mut seen = HashSet::new();
    for t in tensors {
        if t.name.is_empty() {
            return Err(CheckpointError::InvalidInput("a tensor has an empty name".into()));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(CheckpointError::InvalidInput(format!("tensor `{}` is listed twice", t.name)));
        }
        let numel = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        for (what, len) in
            [("master", t.master.len()), ("exp_avg", t.exp_avg.len()), ("exp_avg_sq", t.exp_avg_sq.len())]
        {
            if numel != Some(len) {
                return Err(CheckpointError::InvalidInput(format!(
                    "tensor `{}` has shape {:?} but its {what} has {len} elements",
                    t.name, t.shape
                )));
            }
        }
    }
    Ok(())
}

/// Every file of a checkpoint, each fsynced, into the (temp) folder `tmp`.
fn write_contents(
    tmp: &Path,
    state: &TrainerState,
    config_json: &str,
    tensors: &[TensorState],
    faults: &FaultPlan,
) -> Result<()> {
    let model_path = tmp.join(MODEL_FILE);
    // The bf16 copy is half the masters' size; converting tensors in parallel keeps a 1B-param
    // drafter's save to a fraction of a second of CPU.
    let model: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .par_iter()
        .map(|t| (t.name.clone(), Dtype::BF16, t.shape.clone(), crate::tensor::f32_to_bf16_bytes(&t.master)))
        .collect();
    weights::write_safetensors_atomic(&model_path, &model, None)
        .map_err(|e| CheckpointError::Write { path: model_path.clone(), reason: e.to_string() })?;
    drop(model);

    if faults.abort_mid_checkpoint {
        // Fault injection (module doc): die like a kill -9 would, half-way through a save.
        std::process::abort();
    }

    write_optimizer(&tmp.join(OPTIMIZER_FILE), tensors)?;
    let config_path = tmp.join(CONFIG_FILE);
    weights::write_file_atomic(&config_path, config_json.as_bytes())
        .map_err(|e| CheckpointError::Write { path: config_path.clone(), reason: e.to_string() })?;
    let state_path = tmp.join(STATE_FILE);
    let state_json = serde_json::to_string_pretty(state)
        .map_err(|e| CheckpointError::Write { path: state_path.clone(), reason: e.to_string() })?;
    weights::write_file_atomic(&state_path, state_json.as_bytes())
        .map_err(|e| CheckpointError::Write { path: state_path.clone(), reason: e.to_string() })?;
    fsync_dir(tmp)
}

/// A borrowed f32 tensor for the safetensors writer: the optimizer state is 12 bytes per
/// parameter (12 GB for a 1B drafter), so it is streamed from the caller's vectors rather than
/// copied into byte buffers first (which `weights::write_safetensors_atomic` would need).
struct F32View<'a> {
    shape: &'a [usize],
    data: &'a [f32],
}

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.data))
        } else {
            Cow::Owned(self.data.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.data)
    }
}

fn write_optimizer(path: &Path, tensors: &[TensorState]) -> Result<()> {
    let mut views = Vec::with_capacity(3 * tensors.len());
    for t in tensors {
        for (prefix, data) in [(MASTER, &t.master), (EXP_AVG, &t.exp_avg), (EXP_AVG_SQ, &t.exp_avg_sq)] {
            views.push((format!("{prefix}{}", t.name), F32View { shape: &t.shape, data }));
        }
    }
    // "format": "pt" as in every file weights.rs writes, so Python tools load it too.
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| CheckpointError::Write { path: path.to_path_buf(), reason: e.to_string() })?;
    // serialize_to_file renames its own temp file into place but does not fsync.
    File::open(path).and_then(|f| f.sync_all()).map_err(io(path, "fsync"))
}

/// Moves the complete folder `tmp` to `dir/name` and points `latest` at it, such that `latest`
/// names a complete folder at every instant.
fn publish(dir: &Path, tmp: &Path, name: &str) -> Result<()> {
    let final_dir = dir.join(name);
    let mut source = tmp.to_path_buf();
    if final_dir.exists() {
        // An unreadable `latest` is about to be overwritten anyway: treat it as naming nothing.
        if read_latest(dir).ok().flatten().as_deref() == Some(name) {
            // `latest` names the folder being replaced: point it at the new complete folder
            // first, then build the final folder from hard links (a copy where the file system
            // has none) so that the folder `latest` names never moves.
            write_latest(dir, &tmp.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())?;
            retire(dir, &final_dir)?;
            let link = dir.join(format!(".{name}.link-{}", std::process::id()));
            remove_dir_if_exists(&link)?;
            link_or_copy_dir(tmp, &link)?;
            source = link;
        } else {
            retire(dir, &final_dir)?;
        }
    }
    std::fs::rename(&source, &final_dir).map_err(io(&final_dir, "rename the finished checkpoint to"))?;
    fsync_dir(dir)?;
    write_latest(dir, name)?;
    if source != tmp {
        std::fs::remove_dir_all(tmp).map_err(io(tmp, "remove"))?;
    }
    Ok(())
}

fn write_latest(dir: &Path, name: &str) -> Result<()> {
    let path = dir.join(LATEST_FILE);
    weights::write_file_atomic(&path, format!("{name}\n").as_bytes())
        .map_err(|e| CheckpointError::Write { path: path.clone(), reason: e.to_string() })
}

/// The name of the checkpoint folder [`load_latest`] would load: the one `dir/latest` names, or
/// the newest `step-*` folder where `latest` is missing (`None`: no checkpoint there yet).
pub fn latest_name(dir: impl AsRef<Path>) -> Result<Option<String>> {
    Ok(latest_dir(dir.as_ref())?.and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())))
}

/// The folder name in `dir/latest`, `None` if there is no such file.
fn read_latest(dir: &Path) -> Result<Option<String>> {
    let path = dir.join(LATEST_FILE);
    let content = match std::fs::read_to_string(&path) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&path, "read")(e)),
    };
    let name = content.trim();
    // One plain path component: `latest` may only name a folder beside it.
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(_)), None) => Ok(Some(name.to_string())),
        _ => Err(CheckpointError::BadLatest { path, content }),
    }
}

/// Deletes a folder without ever leaving a half-deleted folder under a `step-*` name: it is
/// renamed to a hidden `.step-*.del-<pid>` first (which [`remove_stale`] also cleans up).
fn retire(dir: &Path, folder: &Path) -> Result<()> {
    let name = folder.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let trash = dir.join(format!(".{name}.del-{}", std::process::id()));
    remove_dir_if_exists(&trash)?;
    std::fs::rename(folder, &trash).map_err(io(folder, "move aside"))?;
    fsync_dir(dir)?;
    std::fs::remove_dir_all(&trash).map_err(io(&trash, "remove"))
}

fn link_or_copy_dir(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir(dst).map_err(io(dst, "create"))?;
    for entry in std::fs::read_dir(src).map_err(io(src, "list"))? {
        let from = entry.map_err(io(src, "list"))?.path();
        let Some(file_name) = from.file_name() else { continue };
        let to = dst.join(file_name);
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(io(&to, "copy into"))?;
            File::open(&to).and_then(|f| f.sync_all()).map_err(io(&to, "fsync"))?;
        }
    }
    fsync_dir(dst)
}

/// `step-*` folders in `dir` as `(step, path)`, ascending.
pub fn step_folders(dir: &Path) -> Result<Vec<(u32, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir, "list"))? {
        let entry = entry.map_err(io(dir, "list"))?;
        let name = entry.file_name();
        if let Some(step) = name.to_str().and_then(parse_step_dir_name) {
            if entry.path().is_dir() {
                out.push((step, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn prune(dir: &Path, saved_step: u32, keep_last: usize) -> Result<()> {
    if keep_last == 0 {
        return Ok(());
    }
    let older: Vec<(u32, PathBuf)> = step_folders(dir)?.into_iter().filter(|(s, _)| *s <= saved_step).collect();
    // The saved step is the newest of these, so it is always among the kept.
    for (_, path) in older.iter().rev().skip(keep_last) {
        retire(dir, path)?;
    }
    Ok(())
}

/// Removes what interrupted saves leave: hidden `.step-*` folders (temp, link and retired
/// ones) and `latest.tmp-*` files, except anything `latest` names.
fn remove_stale(dir: &Path) -> Result<()> {
    let keep = read_latest(dir)?;
    for entry in std::fs::read_dir(dir).map_err(io(dir, "list"))? {
        let entry = entry.map_err(io(dir, "list"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if keep.as_deref() == Some(name.as_str()) {
            continue;
        }
        let path = entry.path();
        if name.starts_with(".step-") && path.is_dir() {
            std::fs::remove_dir_all(&path).map_err(io(&path, "remove a stale temp folder"))?;
        } else if name.starts_with(&format!("{LATEST_FILE}.tmp-")) && path.is_file() {
            std::fs::remove_file(&path).map_err(io(&path, "remove a stale temp file"))?;
        }
    }
    Ok(())
}

fn remove_dir_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(path, "remove")(e)),
        _ => Ok(()),
    }
}

/// A rename or a new file is durable only once its directory entry is.
fn fsync_dir(path: &Path) -> Result<()> {
    File::open(path).and_then(|d| d.sync_all()).map_err(io(path, "fsync directory"))
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

/// The checkpoint `dir/latest` names; `Ok(None)` when `dir` holds no checkpoint. If `latest` is
/// missing but `step-*` folders exist (a crash between publishing the first checkpoint and
/// writing `latest`), the newest of them is loaded: a folder gets its `step-*` name only once
/// complete.
pub fn load_latest(dir: impl AsRef<Path>) -> Result<Option<Loaded>> {
    latest_dir(dir.as_ref())?.map(load).transpose()
}

/// The folder [`load_latest`] would load, `None` where there is no checkpoint.
fn latest_dir(dir: &Path) -> Result<Option<PathBuf>> {
    if !dir.is_dir() {
        return Ok(None);
    }
    match read_latest(dir)? {
        Some(name) => {
            let target = dir.join(&name);
            if !target.is_dir() {
                return Err(CheckpointError::LatestDangling { latest: dir.join(LATEST_FILE), target });
            }
            Ok(Some(target))
        }
        None => Ok(step_folders(dir)?.pop().map(|(_, newest)| newest)),
    }
}

/// The trainer state of the checkpoint [`load_latest`] would load, and its folder, read alone
/// (no tensors): what a resume can check before anything is loaded.
pub fn latest_state(dir: impl AsRef<Path>) -> Result<Option<(PathBuf, TrainerState)>> {
    latest_dir(dir.as_ref())?.map(|d| read_state(&d).map(|st| (d, st))).transpose()
}

/// A checkpoint folder's trainer state, checked against the folder's `step-*` name.
fn read_state(dir: &Path) -> Result<TrainerState> {
    let state_path = dir.join(STATE_FILE);
    let state_text = read_text(&state_path)?;
    let state: TrainerState = serde_json::from_str(&state_text)
        .map_err(|e| CheckpointError::BadState { path: state_path.clone(), reason: e.to_string() })?;
    // The folder's own name (when it is a `step-*` name) must agree with the state inside.
    if let Some(folder_step) = dir.file_name().and_then(|n| n.to_str()).and_then(parse_step_dir_name) {
        if folder_step != state.step {
            return Err(CheckpointError::StepMismatch { path: state_path, folder_step, state_step: state.step });
        }
    }
    Ok(state)
}

/// Reads one checkpoint folder and checks it whole: every file present and parseable, the
/// three optimizer tensors of every model tensor present in f32 with one shape, and every bf16
/// model value equal to its rounded master (which catches damage to either file's data; damage
/// to the moments' data alone goes unnoticed, as safetensors has no checksums).
pub fn load(step_dir: impl AsRef<Path>) -> Result<Loaded> {
    let dir = step_dir.as_ref();
    if !dir.is_dir() {
        return Err(CheckpointError::MissingCheckpoint { path: dir.to_path_buf() });
    }
    let state = read_state(dir)?;
    let config_json = read_text(&dir.join(CONFIG_FILE))?;
    let opt_path = dir.join(OPTIMIZER_FILE);
    let model_path = dir.join(MODEL_FILE);
    let opt = open_store(&opt_path)?;
    let model = open_store(&model_path)?;

    let names: Vec<&str> = opt.names().into_iter().filter_map(|n| n.strip_prefix(MASTER)).collect();
    if names.is_empty() {
        return Err(CheckpointError::MissingTensor { path: opt_path, name: format!("{MASTER}*") });
    }
    let known: HashSet<&str> = names.iter().copied().collect();
    for n in opt.names() {
        let base = [MASTER, EXP_AVG_SQ, EXP_AVG].iter().find_map(|p| n.strip_prefix(p));
        if !base.is_some_and(|b| known.contains(b)) {
            return Err(CheckpointError::UnexpectedTensor { path: opt_path, name: n.to_string() });
        }
    }
    if let Some(extra) = model.names().into_iter().find(|n| !known.contains(n)) {
        return Err(CheckpointError::UnexpectedTensor { path: model_path, name: extra.to_string() });
    }

    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let shape = f32_tensor_meta(&opt, &opt_path, &format!("{MASTER}{name}"), None)?;
        let read = |prefix: &str| -> Result<Vec<f32>> {
            let full = format!("{prefix}{name}");
            f32_tensor_meta(&opt, &opt_path, &full, Some(&shape))?;
            opt.tensor_f32(&full, &shape)
                .map_err(|source| CheckpointError::Unreadable { path: opt_path.clone(), source })
        };
        let t = TensorState {
            name: name.to_string(),
            master: read(MASTER)?,
            exp_avg: read(EXP_AVG)?,
            exp_avg_sq: read(EXP_AVG_SQ)?,
            shape,
        };
        check_model_tensor(&model, &model_path, &opt_path, &t)?;
        tensors.push(t);
    }
    Ok(Loaded { dir: dir.to_path_buf(), state, config_json, tensors })
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::MissingFile { path: path.to_path_buf() },
        std::io::ErrorKind::InvalidData => {
            CheckpointError::BadState { path: path.to_path_buf(), reason: "not UTF-8 text".into() }
        }
        _ => io(path, "read")(e),
    })
}

fn open_store(path: &Path) -> Result<TensorStore> {
    if !path.is_file() {
        return Err(CheckpointError::MissingFile { path: path.to_path_buf() });
    }
    TensorStore::open_file(path).map_err(|source| CheckpointError::Unreadable { path: path.to_path_buf(), source })
}

/// Checks that `name` exists in f32 (and has `shape`, if given); returns its shape.
fn f32_tensor_meta(store: &TensorStore, path: &Path, name: &str, shape: Option<&[usize]>) -> Result<Vec<usize>> {
    let meta = store
        .tensor_info(name)
        .map_err(|_| CheckpointError::MissingTensor { path: path.to_path_buf(), name: name.to_string() })?;
    if meta.dtype != Dtype::F32 {
        return Err(CheckpointError::WrongDtype {
            path: path.to_path_buf(),
            name: name.to_string(),
            expected: Dtype::F32,
            found: meta.dtype,
        });
    }
    if let Some(shape) = shape.filter(|s| *s != meta.shape.as_slice()) {
        return Err(CheckpointError::ShapeMismatch {
            path: path.to_path_buf(),
            name: name.to_string(),
            expected: shape.to_vec(),
            found: meta.shape,
            expected_from: "its master",
        });
    }
    Ok(meta.shape)
}

/// The model file must hold `bf16(master)` bit for bit.
fn check_model_tensor(model: &TensorStore, path: &Path, opt_path: &Path, t: &TensorState) -> Result<()> {
    let raw = model
        .tensor_bytes(&t.name)
        .map_err(|_| CheckpointError::MissingTensor { path: path.to_path_buf(), name: t.name.clone() })?;
    if raw.dtype != Dtype::BF16 {
        return Err(CheckpointError::WrongDtype {
            path: path.to_path_buf(),
            name: t.name.clone(),
            expected: Dtype::BF16,
            found: raw.dtype,
        });
    }
    if raw.shape != t.shape.as_slice() {
        return Err(CheckpointError::ShapeMismatch {
            path: path.to_path_buf(),
            name: t.name.clone(),
            expected: t.shape.clone(),
            found: raw.shape.to_vec(),
            expected_from: "its master in optimizer.safetensors",
        });
    }
    let stored = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    let bad = t
        .master
        .par_iter()
        .zip(raw.bytes.par_chunks_exact(2))
        .position_first(|(&m, b)| bf16::from_f32(m).to_bits() != stored(b));
    match bad {
        None => Ok(()),
        Some(index) => Err(CheckpointError::ModelDisagrees {
            model: path.to_path_buf(),
            optimizer: opt_path.to_path_buf(),
            name: t.name.clone(),
            index,
            stored: stored(&raw.bytes[2 * index..]),
            expected: bf16::from_f32(t.master[index]).to_bits(),
        }),
    }
}

/// A warm start's weights (`run --init-from`): every trained tensor as f32, by name.
#[derive(Clone, Debug)]
pub struct InitWeights {
    /// The checkpoint folder read.
    pub dir: PathBuf,
    /// `true`: the f32 masters of this engine's optimizer.safetensors (exact); `false`: the bf16
    /// model.safetensors of a published drafter, widened.
    pub from_masters: bool,
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

/// The checkpoint folder `--init-from DIR` means: DIR itself when it holds a model, else the
/// latest checkpoint of the run folder DIR.
fn init_folder(dir: &Path) -> Result<PathBuf> {
    if dir.join(MODEL_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    if dir.is_dir() {
        if let Some(name) = read_latest(dir)? {
            return Ok(dir.join(name));
        }
        if let Some((_, newest)) = step_folders(dir)?.pop() {
            return Ok(newest);
        }
    }
    Err(CheckpointError::NoInitCheckpoint { path: dir.to_path_buf() })
}

/// The checkpoint folder a warm start from `dir` reads, its config.json checked against `ours`
/// (the first field that differs named): [`load_init`]'s checks without the tensors, which a run
/// makes before its target loads.
pub fn check_init(dir: impl AsRef<Path>, ours: &crate::config::DrafterConfig) -> Result<PathBuf> {
    let dir = init_folder(dir.as_ref())?;
    let cfg_path = dir.join(CONFIG_FILE);
    if !cfg_path.is_file() {
        return Err(CheckpointError::MissingFile { path: cfg_path });
    }
    let theirs = crate::config::DrafterConfig::from_file(&cfg_path)
        .map_err(|source| CheckpointError::InitConfig { path: dir.clone(), source })?;
    if let Some(d) = ours.first_difference(&theirs) {
        let crate::config::ConfigDifference { field, ours, theirs, from_target } = d;
        return Err(CheckpointError::InitMismatch { path: dir, field, theirs, ours, from_target });
    }
    Ok(dir)
}

/// Reads a warm start from `dir` and checks its config.json against `ours` (the run's drafter),
/// naming the first field that differs. A checkpoint this engine wrote gives its f32 masters
/// (checked against its model file as [`load`] does); a published one its bf16 model tensors.
pub fn load_init(dir: impl AsRef<Path>, ours: &crate::config::DrafterConfig) -> Result<InitWeights> {
    let dir = check_init(dir, ours)?;
    let mut tensors = HashMap::new();
    let from_masters = dir.join(OPTIMIZER_FILE).is_file() && dir.join(STATE_FILE).is_file();
    if from_masters {
        for t in load(&dir)?.tensors {
            tensors.insert(t.name, (t.shape, t.master));
        }
    } else {
        let path = dir.join(MODEL_FILE);
        let model = open_store(&path)?;
        for name in model.names() {
            let meta =
                model.tensor_info(name).map_err(|source| CheckpointError::Unreadable { path: path.clone(), source })?;
            let v = model
                .tensor_f32(name, &meta.shape)
                .map_err(|source| CheckpointError::Unreadable { path: path.clone(), source })?;
            tensors.insert(name.to_string(), (meta.shape, v));
        }
    }
    Ok(InitWeights { dir, from_masters, tensors })
}

/// Sets the drafter's weights (masters and the bf16 copies) from a warm start and zeroes its
/// gradients and AdamW moments. Every tensor of the drafter must be there with its shape, and
/// nothing else may be: a name the drafter does not know (a prefix, a fused projection, an
/// embedding) is an error, not silently skipped.
pub fn apply_init<B: Backend>(
    be: &B,
    s: &B::Stream,
    side: &mut DrafterSide<B>,
    init: &InitWeights,
) -> std::result::Result<(), CheckpointError> {
    let model = init.dir.join(MODEL_FILE);
    let mut used = 0usize;
    let groups: Vec<&mut ParamGroup<B>> = side.fc.iter_mut().chain(std::iter::once(&mut side.drafter.body)).collect();
    let mut known: HashSet<String> = HashSet::new();
    for g in groups {
        let mut host = vec![0.0f32; g.table.total()];
        for e in g.table.entries() {
            known.insert(e.name.clone());
            let (shape, v) = init
                .tensors
                .get(&e.name)
                .ok_or_else(|| CheckpointError::MissingTensor { path: model.clone(), name: e.name.clone() })?;
            if *shape != e.shape {
                return Err(CheckpointError::ShapeMismatch {
                    path: model.clone(),
                    name: e.name.clone(),
                    expected: e.shape.clone(),
                    found: shape.clone(),
                    expected_from: "this run's drafter",
                });
            }
            host[e.offset..e.offset + e.numel].copy_from_slice(v);
            used += 1;
        }
        g.set_masters(be, s, &host)
            .map_err(|e| CheckpointError::InvalidInput(format!("uploading the warm start: {e}")))?;
    }
    if used != init.tensors.len() {
        let mut extra: Vec<&String> = init.tensors.keys().filter(|n| !known.contains(*n)).collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(CheckpointError::UnexpectedTensor { path: model, name: (*name).clone() });
        }
    }
    Ok(())
}

/// Host copies of every trained tensor (masters and moments) for a checkpoint: the fc group
/// (with the drafter rank, or with the target under split-FC) and the body.
pub fn gather<B: Backend>(
    bt: &B,
    st: &B::Stream,
    bd: &B,
    sd: &B::Stream,
    side: &mut DrafterSide<B>,
    remote_fc: Option<&Mutex<ParamGroup<B>>>,
) -> std::result::Result<Vec<TensorState>, Box<dyn std::error::Error + Send + Sync>> {
    // The last update may still run on its own stream (`DrafterSide::overlap_updates`).
    side.join_update(bd, sd)?;
    let mut out = Vec::new();
    let mut take = |be: &B, s: &B::Stream, g: &ParamGroup<B>| -> std::result::Result<(), BackendError> {
        let (master, (m, v)) = (g.masters(be, s)?, g.moments.download(be, s)?);
        for e in g.table.entries() {
            let r = e.offset..e.offset + e.numel;
            out.push(TensorState {
                name: e.name.clone(),
                shape: e.shape.clone(),
                master: master[r.clone()].to_vec(),
                exp_avg: m[r.clone()].to_vec(),
                exp_avg_sq: v[r].to_vec(),
            });
        }
        Ok(())
    };
    match (&side.fc, remote_fc) {
        (Some(fc), _) => take(bd, sd, fc)?,
        (None, Some(fc)) => take(bt, st, &*fc.lock().map_err(|_| "fc group lock poisoned")?)?,
        (None, None) => return Err("no fc group on either side".into()),
    }
    take(bd, sd, &side.drafter.body)?;
    Ok(out)
}

/// Puts checkpointed masters and moments back (and the bf16 weights from the masters).
pub fn restore<B: Backend>(
    be: &B,
    s: &B::Stream,
    side: &mut DrafterSide<B>,
    tensors: &[TensorState],
) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let groups: Vec<&mut ParamGroup<B>> = side.fc.iter_mut().chain(std::iter::once(&mut side.drafter.body)).collect();
    for g in groups {
        let n = g.table.total();
        let (mut master, mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        for e in g.table.entries() {
            let t = tensors
                .iter()
                .find(|t| t.name == e.name)
                .ok_or_else(|| format!("checkpoint has no tensor {}", e.name))?;
            if t.shape != e.shape {
                return Err(format!(
                    "checkpoint tensor {}: shape {:?}, this drafter needs {:?}",
                    e.name, t.shape, e.shape
                )
                .into());
            }
            let r = e.offset..e.offset + e.numel;
            master[r.clone()].copy_from_slice(&t.master);
            m[r.clone()].copy_from_slice(&t.exp_avg);
            v[r].copy_from_slice(&t.exp_avg_sq);
        }
        be.set_master(s, &master, &mut g.master, &mut g.weights)?;
        g.moments.upload(be, s, &m, &v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::TempDir;

    fn state(step: u32) -> TrainerState {
        TrainerState {
            step,
            seed: u64::MAX - 1, // beyond 2^53: must survive JSON exactly
            run_fingerprint: serde_json::json!({"lr": 0.003}),
            extra: serde_json::json!({"loss": 1.25, "note": "x"}),
        }
    }

    /// Values that a lossy path would change: signed zeros, subnormals, extremes, a NaN
    /// payload, and ties of the bf16 rounding.
    fn awkward() -> Vec<f32> {
        vec![
            -0.0,
            0.0,
            f32::from_bits(1),
            f32::from_bits(0x807f_ffff),
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7fc0_1234),
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -0.1,
            std::f32::consts::PI,
        ]
    }

    /// Three tensors, deliberately not in name order, whose values depend on `salt`.
    fn tensors(salt: f32) -> Vec<TensorState> {
        let make = |name: &str, shape: Vec<usize>, base: Vec<f32>| {
            let n: usize = shape.iter().product();
            // Salt 0 keeps the awkward values exactly (adding +0.0 would turn -0.0 into +0.0).
            let value = |i: usize, k: f32| {
                let x = base[i % base.len()] * k;
                if salt == 0.0 {
                    x
                } else {
                    x + salt * (i + 1) as f32
                }
            };
            let v = |k: f32| -> Vec<f32> { (0..n).map(|i| value(i, k)).collect() };
            TensorState { name: name.into(), shape, master: v(1.0), exp_avg: v(-0.5), exp_avg_sq: v(0.25) }
        };
        vec![
            make("norm.weight", vec![14], awkward()),
            make("fc.weight", vec![3, 14], awkward()),
            make("layers.0.self_attn.q_proj.weight", vec![2, 7], vec![0.02, -0.03, 1e-40]),
        ]
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn assert_same(loaded: &[TensorState], saved: &[TensorState]) {
        let mut want = saved.to_vec();
        want.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(loaded.len(), want.len());
        for (l, w) in loaded.iter().zip(&want) {
            assert_eq!((&l.name, &l.shape), (&w.name, &w.shape));
            assert_eq!(bits(&l.master), bits(&w.master), "{}", w.name);
            assert_eq!(bits(&l.exp_avg), bits(&w.exp_avg), "{}", w.name);
            assert_eq!(bits(&l.exp_avg_sq), bits(&w.exp_avg_sq), "{}", w.name);
        }
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    fn latest(dir: &Path) -> String {
        std::fs::read_to_string(dir.join(LATEST_FILE)).unwrap()
    }

    const CONFIG: &str = r#"{"architectures": ["DFlashDraftModel"], "num_hidden_layers": 1}"#;

    #[test]
    fn round_trip_is_bit_exact() {
        let run = TempDir::new("roundtrip");
        let t = tensors(0.0);
        let path = save(&run.0, &state(100), CONFIG, &t, 3).unwrap();
        assert_eq!(path, run.0.join("step-00000100"));
        assert_eq!(entries(&path), vec![CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE]);
        let l = load(&path).unwrap();
        assert_eq!(l.dir, path);
        assert_eq!(l.state, state(100));
        assert_eq!(l.config_json, CONFIG);
        assert_same(&l.tensors, &t);
        let names: Vec<&str> = l.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["fc.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"], "sorted by name");
        let l2 = load_latest(&run.0).unwrap().unwrap();
        assert_eq!(l2.dir, path);
        // Lookup by name with the caller's shape.
        assert_eq!(l.tensor("norm.weight", &[14]).unwrap().master.len(), 14);
    }

    #[test]
    fn model_file_is_round_to_nearest_even_of_the_masters() {
        let run = TempDir::new("bf16");
        let t = tensors(0.0);
        let path = save(&run.0, &state(1), CONFIG, &t, 0).unwrap();
        let store = TensorStore::open_file(path.join(MODEL_FILE)).unwrap();
        assert_eq!(store.names(), ["fc.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"]);
        for ts in &t {
            let raw = store.tensor_bytes(&ts.name).unwrap();
            assert_eq!(raw.dtype, Dtype::BF16);
            assert_eq!(raw.shape, ts.shape.as_slice());
            let got: Vec<u16> = raw.bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let want: Vec<u16> = ts.master.iter().map(|&m| bf16::from_f32(m).to_bits()).collect();
            assert_eq!(got, want, "{}", ts.name);
        }
        // The ties went to even: 1 + 2^-8 -> 1.0, 1 + 3 * 2^-8 -> 1 + 2^-6.
        let norm = store.tensor_f32("norm.weight", &[14]).unwrap();
        assert_eq!((norm[10], norm[11]), (1.0, 1.0 + 1.0 / 64.0));
        assert_eq!(norm[0].to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn latest_follows_each_save_and_keep_last_prunes_the_oldest() {
        let run = TempDir::new("prune");
        for step in 1..=5u32 {
            save(&run.0, &state(step * 10), CONFIG, &tensors(step as f32), 2).unwrap();
            assert_eq!(latest(&run.0), format!("{}\n", step_dir_name(step * 10)));
            assert_eq!(load_latest(&run.0).unwrap().unwrap().state.step, step * 10);
        }
        assert_eq!(entries(&run.0), vec![LATEST_FILE, "step-00000040", "step-00000050"]);
        assert_same(&load_latest(&run.0).unwrap().unwrap().tensors, &tensors(5.0));
        // keep_last 0 keeps everything.
        save(&run.0, &state(60), CONFIG, &tensors(6.0), 0).unwrap();
        save(&run.0, &state(70), CONFIG, &tensors(7.0), 0).unwrap();
        assert_eq!(entries(&run.0).len(), 1 + 4);
        // keep_last 1 after resuming from an earlier step: later folders (another trajectory)
        // stay, older ones go, the new one is kept.
        save(&run.0, &state(55), CONFIG, &tensors(5.5), 1).unwrap();
        assert_eq!(entries(&run.0), vec![LATEST_FILE, "step-00000055", "step-00000060", "step-00000070"]);
        assert_eq!(load_latest(&run.0).unwrap().unwrap().state.step, 55);
    }

    #[test]
    fn stale_temp_folders_are_removed_by_the_next_save() {
        let run = TempDir::new("stale");
        save(&run.0, &state(1), CONFIG, &tensors(1.0), 3).unwrap();
        for leftover in [".step-00000002.tmp-999999", ".step-00000001.del-17", ".step-00000001.link-17"] {
            std::fs::create_dir(run.0.join(leftover)).unwrap();
            std::fs::write(run.0.join(leftover).join(MODEL_FILE), b"partial").unwrap();
        }
        std::fs::write(run.0.join("latest.tmp-4242"), b"step-0").unwrap();
        std::fs::write(run.0.join("notes.txt"), b"mine").unwrap();
        save(&run.0, &state(2), CONFIG, &tensors(2.0), 3).unwrap();
        assert_eq!(entries(&run.0), vec![LATEST_FILE, "notes.txt", "step-00000001", "step-00000002"]);
    }

    #[test]
    fn leftover_of_a_crashed_save_does_not_disturb_load_latest() {
        // What a kill during the save of step 2 leaves: a hidden temp folder with a partial
        // model file, `latest` still naming step 1.
        let run = TempDir::new("simcrash");
        let good = tensors(1.0);
        save(&run.0, &state(1), CONFIG, &good, 3).unwrap();
        let tmp = run.0.join(".step-00000002.tmp-12345");
        std::fs::create_dir(&tmp).unwrap();
        let full = std::fs::read(run.0.join("step-00000001").join(MODEL_FILE)).unwrap();
        std::fs::write(tmp.join(MODEL_FILE), &full[..full.len() / 2]).unwrap();
        let l = load_latest(&run.0).unwrap().unwrap();
        assert_eq!(l.state.step, 1);
        assert_same(&l.tensors, &good);
    }

    /// Environment variable that makes [`crash_child`] do its work; set only on the child.
    const CHILD_DIR_ENV: &str = "DFLASH_CHECKPOINT_CRASH_CHILD_DIR";

    /// The child process of `abort_mid_save_leaves_the_previous_checkpoint`: saves step 2 with
    /// the fault injected, which must abort the process.
    #[test]
    #[ignore = "child process of abort_mid_save_leaves_the_previous_checkpoint"]
    fn crash_child() {
        let Some(dir) = std::env::var_os(CHILD_DIR_ENV) else { return };
        let faults = FaultPlan { abort_mid_checkpoint: true, ..FaultPlan::default() };
        let _ = save_with(PathBuf::from(dir), &state(2), CONFIG, &tensors(2.0), 3, &faults);
        panic!("save returned although the fault plan aborts mid-checkpoint");
    }

    #[test]
    fn abort_mid_save_leaves_the_previous_checkpoint() {
        let run = TempDir::new("abort");
        let good = tensors(1.0);
        save(&run.0, &state(1), CONFIG, &good, 3).unwrap();
        // Re-run this test binary on the child test alone, with the fault switched on.
        let test_name = format!("{}::crash_child", module_path!().split_once("::").map_or("", |(_, rest)| rest));
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([test_name.as_str(), "--exact", "--ignored", "--test-threads=1"])
            .env(CHILD_DIR_ENV, &run.0)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stdout);
        assert!(log.contains("running 1 test"), "the child did not run {test_name}: {log}");
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(out.status.signal(), Some(6), "the child should die of SIGABRT: {:?}\n{log}", out.status);
        }
        assert!(!out.status.success());
        // The child got as far as the model file of step 2, in a hidden temp folder.
        let names = entries(&run.0);
        assert_eq!(names.len(), 3, "{names:?}");
        assert_eq!(&names[1..], [LATEST_FILE, "step-00000001"]);
        assert!(names[0].starts_with(".step-00000002.tmp-"), "{names:?}");
        assert_eq!(entries(&run.0.join(&names[0])), vec![MODEL_FILE]);
        assert_eq!(latest(&run.0), "step-00000001\n");
        let l = load_latest(&run.0).unwrap().unwrap();
        assert_eq!(l.state, state(1));
        assert_same(&l.tensors, &good);
        // Training resumes and the next save tidies up.
        save(&run.0, &state(2), CONFIG, &tensors(2.0), 3).unwrap();
        assert_eq!(entries(&run.0), vec![LATEST_FILE, "step-00000001", "step-00000002"]);
    }

    #[test]
    fn saving_a_step_again_replaces_it() {
        let run = TempDir::new("resave");
        save(&run.0, &state(1), CONFIG, &tensors(1.0), 3).unwrap();
        save(&run.0, &state(2), CONFIG, &tensors(2.0), 3).unwrap();
        // `latest` names the folder being replaced.
        save(&run.0, &state(2), CONFIG, &tensors(-2.0), 3).unwrap();
        assert_eq!(entries(&run.0), vec![LATEST_FILE, "step-00000001", "step-00000002"]);
        assert_same(&load_latest(&run.0).unwrap().unwrap().tensors, &tensors(-2.0));
        // A crash while replacing the step `latest` names leaves `latest` on our temp folder
        // (same pid after a restart, as in a container): saving that step again keeps it until
        // the new one is published.
        let pid_tmp = run.0.join(format!(".step-00000002.tmp-{}", std::process::id()));
        std::fs::rename(run.0.join("step-00000002"), &pid_tmp).unwrap();
        std::fs::write(run.0.join(LATEST_FILE), format!(".step-00000002.tmp-{}\n", std::process::id())).unwrap();
        assert_same(&load_latest(&run.0).unwrap().unwrap().tensors, &tensors(-2.0));
        save(&run.0, &state(2), CONFIG, &tensors(2.5), 3).unwrap();
        assert_eq!(entries(&run.0), vec![LATEST_FILE, "step-00000001", "step-00000002"]);
        assert_same(&load_latest(&run.0).unwrap().unwrap().tensors, &tensors(2.5));
        // `latest` names another folder (a crash between the rename and `latest`).
        std::fs::write(run.0.join(LATEST_FILE), "step-00000001\n").unwrap();
        save(&run.0, &state(2), CONFIG, &tensors(3.0), 3).unwrap();
        assert_eq!(latest(&run.0), "step-00000002\n");
        assert_same(&load_latest(&run.0).unwrap().unwrap().tensors, &tensors(3.0));
        assert_eq!(entries(&run.0), vec![LATEST_FILE, "step-00000001", "step-00000002"]);
    }

    #[test]
    fn latest_is_checked() {
        let run = TempDir::new("latest");
        assert!(load_latest(run.0.join("nothing-here")).unwrap().is_none());
        assert!(load_latest(&run.0).unwrap().is_none());
        save(&run.0, &state(3), CONFIG, &tensors(1.0), 3).unwrap();
        std::fs::write(run.0.join(LATEST_FILE), "step-00000009\n").unwrap();
        match load_latest(&run.0) {
            Err(e @ CheckpointError::LatestDangling { .. }) => {
                assert!(e.to_string().contains("step-00000009"), "{e}");
                assert!(e.to_string().contains(&run.0.join(LATEST_FILE).display().to_string()), "{e}");
            }
            other => panic!("{other:?}"),
        }
        for bad in ["../step-00000003", "", "/tmp", "a/b"] {
            std::fs::write(run.0.join(LATEST_FILE), bad).unwrap();
            assert!(matches!(load_latest(&run.0), Err(CheckpointError::BadLatest { .. })), "{bad:?}");
        }
        // No `latest` at all (crash before the first one was written): the newest folder.
        std::fs::remove_file(run.0.join(LATEST_FILE)).unwrap();
        assert_eq!(load_latest(&run.0).unwrap().unwrap().state.step, 3);
    }

    #[test]
    fn save_refuses_inconsistent_tensors() {
        let run = TempDir::new("invalid");
        let mut t = tensors(1.0);
        t[1].exp_avg.pop();
        let e = save(&run.0, &state(1), CONFIG, &t, 3).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::InvalidInput(m) if m.contains("fc.weight") && m.contains("exp_avg")),
            "{e}"
        );
        let mut t = tensors(1.0);
        t[2].name = t[0].name.clone();
        assert!(matches!(save(&run.0, &state(1), CONFIG, &t, 3), Err(CheckpointError::InvalidInput(_))));
        assert!(matches!(save(&run.0, &state(1), CONFIG, &[], 3), Err(CheckpointError::InvalidInput(_))));
        // Nothing was published.
        assert_eq!(entries(&run.0), Vec::<String>::new());
    }

    #[test]
    fn loaded_tensor_checks_name_and_shape() {
        let run = TempDir::new("lookup");
        save(&run.0, &state(4), CONFIG, &tensors(1.0), 3).unwrap();
        let l = load_latest(&run.0).unwrap().unwrap();
        let opt = run.0.join("step-00000004").join(OPTIMIZER_FILE);
        let e = l.tensor("layers.1.self_attn.q_proj.weight", &[2, 7]).unwrap_err();
        assert!(matches!(&e, CheckpointError::MissingTensor { path, .. } if *path == opt), "{e}");
        let e = l.tensor("fc.weight", &[14, 3]).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::ShapeMismatch { path, found, .. } if *path == opt && *found == [3, 14]),
            "{e}"
        );
        assert!(e.to_string().contains("another drafter config"), "{e}");
    }

    #[test]
    fn damaged_files_are_named() {
        let run = TempDir::new("damage");
        let good = save(&run.0, &state(7), CONFIG, &tensors(1.0), 3).unwrap();
        // Fresh copy of the good checkpoint, damaged by `f`; returns the load error.
        let damaged = |file: &str, f: &dyn Fn(&Path)| -> CheckpointError {
            let dir = run.0.join(format!("copy-of-7-{file}"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir(&dir).unwrap();
            for name in [CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE] {
                std::fs::copy(good.join(name), dir.join(name)).unwrap();
            }
            f(&dir.join(file));
            let e = load(&dir).expect_err("the damage went unnoticed");
            assert!(e.to_string().contains(&dir.join(file).display().to_string()), "{file}: {e}");
            e
        };
        let truncate = |p: &Path| {
            let len = std::fs::metadata(p).unwrap().len();
            std::fs::OpenOptions::new().write(true).open(p).unwrap().set_len(len - 3).unwrap();
        };
        let garbage = |p: &Path| std::fs::write(p, b"\x10\0\0\0\0\0\0\0not a header at all").unwrap();
        // Flip a bit in the last byte: data, not header.
        let flip = |p: &Path| {
            let mut b = std::fs::read(p).unwrap();
            *b.last_mut().unwrap() ^= 0x40;
            std::fs::write(p, b).unwrap();
        };
        let remove = |p: &Path| std::fs::remove_file(p).unwrap();
        for file in [MODEL_FILE, OPTIMIZER_FILE] {
            assert!(matches!(damaged(file, &truncate), CheckpointError::Unreadable { .. }));
            assert!(matches!(damaged(file, &garbage), CheckpointError::Unreadable { .. }));
            assert!(matches!(damaged(file, &remove), CheckpointError::MissingFile { .. }));
        }
        // A flipped bit in tensor data: the bf16 model and its f32 masters no longer agree. The
        // optimizer file's last tensor is `master.norm.weight` (safetensors orders by name).
        assert!(matches!(damaged(MODEL_FILE, &flip), CheckpointError::ModelDisagrees { .. }));
        assert!(matches!(damaged(OPTIMIZER_FILE, &flip), CheckpointError::ModelDisagrees { .. }));
        let state_without_seed = |p: &Path| std::fs::write(p, "{\"step\": 7}").unwrap();
        assert!(matches!(damaged(STATE_FILE, &state_without_seed), CheckpointError::BadState { .. }));
        assert!(matches!(damaged(STATE_FILE, &remove), CheckpointError::MissingFile { .. }));
        assert!(matches!(damaged(CONFIG_FILE, &remove), CheckpointError::MissingFile { .. }));
        // A model tensor without optimizer state, or of another dtype.
        let extra = |p: &Path| {
            let t = vec![("extra.weight".to_string(), Dtype::BF16, vec![1], vec![0, 0])];
            weights::write_safetensors_atomic(p, &t, None).unwrap();
        };
        assert!(matches!(damaged(MODEL_FILE, &extra), CheckpointError::UnexpectedTensor { .. }));
        let f32_model = |p: &Path| {
            let t: Vec<_> = tensors(1.0)
                .into_iter()
                .map(|t| (t.name, Dtype::F32, t.shape, bytemuck::cast_slice(&t.master).to_vec()))
                .collect();
            weights::write_safetensors_atomic(p, &t, None).unwrap();
        };
        assert!(matches!(damaged(MODEL_FILE, &f32_model), CheckpointError::WrongDtype { .. }));
        // The folder's name and the state inside must agree.
        let renamed = run.0.join("step-00000009");
        std::fs::create_dir(&renamed).unwrap();
        for name in [CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE] {
            std::fs::copy(good.join(name), renamed.join(name)).unwrap();
        }
        assert!(matches!(load(&renamed), Err(CheckpointError::StepMismatch { folder_step: 9, state_step: 7, .. })));
        assert!(matches!(load(run.0.join("step-00000010")), Err(CheckpointError::MissingCheckpoint { .. })));
    }
}
