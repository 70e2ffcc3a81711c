//! The GPU machine's scripts, where their logic runs without a GPU: `scripts/sanitize.sh`'s
//! sharding (SHARD=i/N) with a stub `compute-sanitizer` that records the tests it was given.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::common::Scratch;

/// The kernel modules sanitize.sh takes by default, and the async-vs-sync suite.
const MODULES: [&str; 9] = [
    "gpu::gemm::",
    "gpu::norm::",
    "gpu::elementwise::",
    "gpu::pack::",
    "gpu::attention::",
    "gpu::hybrid::",
    "gpu::hybrid_fused::",
    "gpu::cross_entropy::",
    "gpu::optimizer::",
];
const SUITE: &str = "nan_suite::gpu_async_matches_sync_on_one_gpu";

/// Runs sanitize.sh as shard `i` of `n` (no shard when `n` is 0) with initcheck and racecheck;
/// returns, per tool, the test filters the stub was called with.
fn shard(dir: &Path, i: usize, n: usize) -> BTreeMap<String, Vec<String>> {
    let out = dir.join(format!("out-{i}-{n}"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/sanitize.sh");
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .arg("bundle")
        .env("PATH", path)
        .env("OUT", &out)
        .env("SANITIZERS", "initcheck racecheck")
        .env("STREAM_TESTS", "none")
        .env_remove("KERNEL_TESTS")
        .env_remove("RACE_TESTS")
        .env_remove("SAN_TESTS");
    if n > 0 {
        cmd.env("SHARD", format!("{i}/{n}"));
    } else {
        cmd.env_remove("SHARD");
    }
    let o = cmd.output().expect("bash runs");
    assert!(o.status.success(), "sanitize.sh shard {i}/{n}: {}", String::from_utf8_lossy(&o.stderr));
    let mut by_tool = BTreeMap::new();
    for tool in ["initcheck", "racecheck"] {
        // The stub writes "ARGS <its arguments>" into the tool's log; a shard without tests for
        // a tool does not call it.
        let log = std::fs::read_to_string(out.join(format!("sanitize-{tool}.log"))).unwrap_or_default();
        let tests: Vec<String> = log
            .lines()
            .filter_map(|l| l.strip_prefix("ARGS "))
            .flat_map(|args| {
                let after = args.split("--test-threads=1").nth(1).unwrap_or("");
                let filters = after.split("--skip").next().unwrap_or("");
                filters.split_whitespace().map(String::from).collect::<Vec<_>>()
            })
            .collect();
        by_tool.insert(tool.to_string(), tests);
    }
    by_tool
}

#[test]
fn sanitize_shards_give_every_module_to_exactly_one_shard_per_tool() {
    let scratch = Scratch::new("scripts-sanitize_shards_give_every_module_to_exactly_one_shard_per_tool");
    let dir = scratch.path().to_path_buf();
    let stub = dir.join("compute-sanitizer");
    std::fs::write(&stub, "#!/bin/sh\necho \"ARGS $*\"\necho '========= ERROR SUMMARY: 0 errors'\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for n in 0..=6 {
        let shards: Vec<_> = (0..n.max(1)).map(|i| shard(&dir, i, n)).collect();
        for tool in ["initcheck", "racecheck"] {
            let mut count: BTreeMap<&str, usize> = BTreeMap::new();
            for s in &shards {
                for t in &s[tool] {
                    *count.entry(t.as_str()).or_default() += 1;
                }
            }
            let want: Vec<&str> = MODULES.iter().copied().chain((tool != "racecheck").then_some(SUITE)).collect();
            for m in &want {
                assert_eq!(count.get(m), Some(&1), "{tool}, {n} shards: {m} in {:?} shards", count.get(m));
            }
            assert_eq!(count.len(), want.len(), "{tool}, {n} shards: unexpected filters {count:?}");
        }
        if n > 1 {
            // The suite has shard 0 to itself under the non-race tools.
            assert_eq!(shards[0]["initcheck"], vec![SUITE.to_string()], "{n} shards");
        }
    }
}
