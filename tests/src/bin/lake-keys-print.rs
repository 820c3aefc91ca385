//! Prints the block keys of a fixed prompt, one hex key per line, for the
//! namespace described by its arguments: TENANT REVISION TOKENS. Used by
//! the cross-process key test.

use std::process::ExitCode;

use lake_dp::KeyChain;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [tenant, revision, tokens] = args.as_slice() else {
        eprintln!("usage: lake-keys-print TENANT(0-255) REVISION TOKENS");
        return ExitCode::from(2);
    };
    let (Ok(tenant), Ok(tokens)) = (tenant.parse::<u8>(), tokens.parse::<u32>()) else {
        eprintln!("lake-keys-print: TENANT must be 0-255 and TOKENS a count");
        return ExitCode::from(2);
    };
    let namespace = lake_tests::namespace_from(tenant, revision, "", "");
    match KeyChain::keys(&namespace, &lake_tests::prompt(tokens)) {
        Ok(keys) => {
            for key in keys {
                println!("{key}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lake-keys-print: {e}");
            ExitCode::FAILURE
        }
    }
}
