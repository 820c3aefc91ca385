//! `ffi/include/lake.h` is what cbindgen makes of this crate's exports
//! now; this fails when the checked-in header is stale.
//! `LAKE_UPDATE_HEADER=1 cargo test -p lake-ffi --test header` rewrites it.

use std::path::PathBuf;

#[test]
fn the_checked_in_header_is_current() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = crate_dir.join("include/lake.h");
    if std::env::var_os("LAKE_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let current = std::fs::read(&path).unwrap_or_default();
    assert!(
        current == generated,
        "ffi/include/lake.h is stale: run LAKE_UPDATE_HEADER=1 cargo test -p lake-ffi --test header"
    );
}
