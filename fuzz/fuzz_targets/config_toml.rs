//! The configuration files an operator writes: arbitrary text as
//! `lake serve`'s TOML file (`--config`) and as `lake-dp`'s own. Never a
//! panic; a file is taken or refused with a message naming the file; what
//! `lake serve` takes is checked whole (its pool's settings, the data
//! plane they describe) without a panic, and what `lake-dp` takes passes
//! its own checks or is refused by them.
//!
//! Settings that name files to read (keys, certificates) stop at the
//! command line: reading whatever path the input names (`/dev/zero`) is
//! not the parser's to survive.

#![no_main]

use lake_cp::config::{ServeArgs, text_args};
use lake_dp::runner::config::RunnerConfig;
use libfuzzer_sys::fuzz_target;

/// Settings whose values are files `resolve` reads.
const READS_FILES: [&str; 6] =
    ["--link-key", "--tenant-key", "--tenant-keys", "--etcd-ca", "--etcd-cert", "--etcd-key"];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(config) = RunnerConfig::parse(text) {
        let _ = config.check();
    }
    let args = match text_args(text, "lake.toml") {
        Ok(args) => args,
        Err(why) => {
            assert!(why.starts_with("lake.toml"), "the error names the file: {why}");
            return;
        }
    };
    let mut argv = Vec::new();
    argv.extend(args);
    let Ok(serve) = ServeArgs::parse(&argv) else { return };
    if argv.iter().any(|arg| READS_FILES.iter().any(|flag| arg.starts_with(flag))) {
        return;
    }
    let Ok(resolved) = serve.resolve() else { return };
    if resolved.pool.check().is_ok() {
        let _ = resolved.pool.data_plane(None);
    }
});
