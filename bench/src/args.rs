//! `--name value` argument parsing for the bench subcommands, with errors
//! that name the flag.

use std::collections::BTreeMap;
use std::str::FromStr;

#[derive(Debug)]
pub(crate) struct Args {
    values: BTreeMap<String, String>,
}

impl Args {
    /// Parses `--name value` pairs; `allowed` lists the names the
    /// subcommand knows.
    pub(crate) fn parse(raw: &[String], allowed: &[&str]) -> Result<Self, String> {
        let mut values = BTreeMap::new();
        let mut iter = raw.iter();
        while let Some(flag) = iter.next() {
            let Some(name) = flag.strip_prefix("--") else {
                return Err(format!("unexpected argument `{flag}` (flags look like --name value)"));
            };
            if !allowed.contains(&name) {
                return Err(format!("unknown flag --{name}; known: --{}", allowed.join(", --")));
            }
            let Some(value) = iter.next() else {
                return Err(format!("--{name} needs a value"));
            };
            values.insert(name.to_owned(), value.clone());
        }
        Ok(Self { values })
    }

    pub(crate) fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        match self.values.get(name) {
            None => Ok(default),
            Some(raw) => raw.parse().map_err(|e| format!("--{name} {raw}: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn parses_and_names_bad_flags() {
        let args = Args::parse(&strings(&["--tokens", "64"]), &["tokens", "block-tokens"]).unwrap();
        assert_eq!(args.get("tokens", 0u32).unwrap(), 64);
        assert_eq!(args.get("block-tokens", 16u32).unwrap(), 16);
        assert!(Args::parse(&strings(&["--nope", "1"]), &["tokens"]).unwrap_err().contains("--nope"));
        assert!(Args::parse(&strings(&["--tokens"]), &["tokens"]).unwrap_err().contains("needs a value"));
        let bad = Args::parse(&strings(&["--tokens", "x"]), &["tokens"]).unwrap();
        assert!(bad.get("tokens", 0u32).unwrap_err().contains("--tokens x"));
    }
}
