//! Tidy: what `cargo fmt` and `cargo clippy` do not check, over the whole
//! source tree (TigerBeetle's `tidy.zig`, SPDK's `check_format.sh`).
//!
//! - **Function length**, outside tests: the longest function and the
//!   number over [`FN_LINES_GOAL`] lines are ratchets — neither may grow,
//!   and when one shrinks its constant here is lowered to match, so the
//!   gain is kept.
//! - **File length**: no source file over [`FILE_LINES_MAX`] lines, but
//!   those listed in [`LONG_FILES`], each capped at its length when
//!   listed; a listed file that shrank under the limit leaves the list.
//! - **`unsafe`**, outside tests, only in the files listed in
//!   [`UNSAFE_FILES`]; a listed file that no longer holds any leaves the
//!   list.
//! - **No history in code or docs**: no comment or doc names an issue by
//!   number or a "later issue" (the CHANGELOG holds history).
//! - **No unused dependency**: every dependency a member's manifest
//!   declares is named in that member's sources.
//! - **Arrows point down**: each library crate depends only on the
//!   internal crates [`ARROWS`] allows it (so the compiler keeps the
//!   vocabulary from the daemon, and the data plane and the control plane
//!   from the agent), and the engine's side (`ffi`, the agent) never names
//!   the data plane's runner.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// Where a function is long (TigerBeetle's limit).
const FN_LINES_GOAL: usize = 70;

/// The longest function outside tests, in lines: a ratchet.
const LONGEST_FN_LINES: usize = 443;

/// Functions outside tests longer than [`FN_LINES_GOAL`]: a ratchet.
const FNS_OVER_GOAL: usize = 73;

/// Lines a source file may have, unless listed in [`LONG_FILES`].
const FILE_LINES_MAX: usize = 1000;

/// Files over [`FILE_LINES_MAX`] lines, each with the most it may have.
const LONG_FILES: &[(&str, usize)] = &[
    ("ffi/agent/src/client.rs", 1556),
    ("lake-dp/src/poller.rs", 1306),
    ("lake-dp/src/transport/rdma/pull.rs", 1107),
    ("lake-dp/core/src/wire/message.rs", 1173),
    ("lake-cp/control/src/evict.rs", 1115),
    ("lake-cp/tests/serve.rs", 1058),
    ("kernels/src/gpu.rs", 1167),
];

/// Files outside tests that may hold `unsafe` code.
const UNSAFE_FILES: &[&str] = &[
    "bench/src/ffi.rs",
    "bench/src/gpu.rs",
    "bench/src/l2.rs",
    "bench/src/l3.rs",
    "bench/src/tcp.rs",
    "ffi/agent/src/client.rs",
    "ffi/agent/src/push.rs",
    "ffi/src/fuzzing.rs",
    "ffi/src/gpu.rs",
    "ffi/src/lanes.rs",
    "ffi/src/layout.rs",
    "ffi/src/memory.rs",
    "ffi/src/pool/keys.rs",
    "ffi/src/pool/lookup.rs",
    "ffi/src/pool/mod.rs",
    "ffi/src/pool/register.rs",
    "ffi/src/pool/requests.rs",
    "ffi/src/pool/thread.rs",
    "ffi/src/push.rs",
    "ffi/src/route.rs",
    "ffi/src/status.rs",
    "ffi/src/trace.rs",
    "kernels/src/gpu.rs",
    "lake-cp/control/src/embedded/created.rs",
    "lake-cp/control/src/huge.rs",
    "lake-cp/control/src/metrics.rs",
    "lake-cp/control/src/table.rs",
    "lake-dp/examples/tour.rs",
    "lake-dp/core/src/agent/port.rs",
    "lake-dp/core/src/agent/shm.rs",
    "lake-dp/core/src/arena/mod.rs",
    "lake-dp/core/src/copy.rs",
    "lake-dp/core/src/arena/pins.rs",
    "lake-dp/core/src/arena/view.rs",
    "lake-dp/src/auth/mod.rs",
    "lake-dp/src/auth/peer.rs",
    "lake-dp/src/auth/session.rs",
    "lake-dp/src/io.rs",
    "lake-dp/src/l2.rs",
    "lake-dp/src/l3/mod.rs",
    "lake-dp/core/src/lock.rs",
    "lake-dp/core/src/mirror/mod.rs",
    "lake-dp/core/src/numa.rs",
    "lake-dp/src/poller.rs",
    "lake-dp/core/src/region.rs",
    "lake-dp/core/src/ring.rs",
    "lake-dp/src/runner/mod.rs",
    "lake-dp/src/runner/open.rs",
    "lake-dp/src/runner/serve.rs",
    "lake-dp/core/src/os.rs",
    "lake-dp/src/runner/pool/agents.rs",
    "lake-dp/src/runner/pool/commands.rs",
    "lake-dp/src/runner/pool/compact.rs",
    "lake-dp/src/runner/pool/l3.rs",
    "lake-dp/src/runner/pool/promote.rs",
    "lake-dp/src/runner/pool/remote.rs",
    "lake-dp/src/runner/pool/save.rs",
    "lake-dp/src/runner/pool/verify.rs",
    "lake-dp/src/runner/simulation/link.rs",
    "lake-dp/src/runner/simulation/mod.rs",
    "lake-dp/src/runner/simulation/node.rs",
    "lake-dp/src/runner/pool/mod.rs",
    "lake-dp/core/src/shm.rs",
    "lake-dp/src/sim.rs",
    "lake-dp/src/transport/fallback.rs",
    "lake-dp/src/transport/faults.rs",
    "lake-dp/src/transport/mod.rs",
    "lake-dp/src/transport/rdma.rs",
    "lake-dp/src/transport/rdma/loopback.rs",
    "lake-dp/src/transport/rdma/over_tcp.rs",
    "lake-dp/src/transport/rdma/pull.rs",
    "lake-dp/src/transport/rdma/verbs.rs",
    "lake-dp/src/transport/tcp/mod.rs",
    "lake-dp/src/transport/tcp/receive.rs",
    "lake-dp/src/transport/tcp/send.rs",
    "lake-dp/src/transport/tcp/stream.rs",
    "lake-dp/src/uring.rs",
];

/// The workspace's members, and the fuzz crate (outside the workspace).
const CRATES: &[&str] =
    &["lake-dp/core", "lake-dp", "lake-cp/control", "lake-cp", "ffi/agent", "ffi", "kernels", "bench", "tests", "fuzz"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace holds the tests crate").to_path_buf()
}

/// Every file under `dir` whose name ends in one of `extensions`, as paths
/// relative to the workspace's root, skipping build outputs and crates
/// nested inside (each is walked as its own).
fn files_under(dir: &Path, extensions: &[&str], out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(std::fs::DirEntry::path);
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | "corpus" | "artifacts" | "coverage" | "build" | "node_modules")
                && !name.starts_with('.')
                && !path.join("Cargo.toml").exists()
            {
                files_under(&path, extensions, out);
            }
        } else if extensions.iter().any(|e| name.ends_with(e)) {
            let relative = path.strip_prefix(root()).expect("under the root");
            out.push(relative.to_string_lossy().into_owned());
        }
    }
}

fn rust_files() -> Vec<String> {
    let mut files = Vec::new();
    for krate in CRATES {
        files_under(&root().join(krate), &[".rs"], &mut files);
    }
    files
}

fn read(file: &str) -> String {
    std::fs::read_to_string(root().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// Test code: files of a crate's `tests/`, `benches/` or `examples/`
/// folders and of the tests crate (which is all tests and their tools).
fn is_test_file(file: &str) -> bool {
    file.starts_with("tests/") || file.contains("/tests/") || file.ends_with("/tests.rs")
}

/// Functions outside test code: (file:line, name, lines).
#[derive(Default)]
struct Functions {
    file: String,
    found: Vec<(String, String, usize)>,
}

fn is_test_attribute(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("test")
            || (a.path().is_ident("cfg") && a.meta.require_list().is_ok_and(|l| l.tokens.to_string() == "test"))
    })
}

impl Functions {
    /// A function from its `fn` to its closing brace (its attributes and
    /// doc comment not counted).
    fn note(&mut self, signature: &syn::Signature, body: &syn::Block) {
        let (start, end): (proc_macro2::LineColumn, _) =
            (signature.fn_token.span.start(), body.brace_token.span.close().end());
        let (start, end) = (start.line, end.line);
        self.found.push((format!("{}:{start}", self.file), signature.ident.to_string(), end - start + 1));
    }
}

impl<'ast> Visit<'ast> for Functions {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !is_test_attribute(&item.attrs) {
            syn::visit::visit_item_mod(self, item);
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if !is_test_attribute(&item.attrs) {
            self.note(&item.sig, &item.block);
            syn::visit::visit_item_fn(self, item);
        }
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if !is_test_attribute(&item.attrs) {
            self.note(&item.sig, &item.block);
            syn::visit::visit_impl_item_fn(self, item);
        }
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let Some(body) = &item.default {
            self.note(&item.sig, body);
        }
        syn::visit::visit_trait_item_fn(self, item);
    }
}

/// Whether a parsed file holds `unsafe` code: a block, a function, an
/// impl, a trait or a foreign module.
#[derive(Default)]
struct Unsafety(bool);

impl<'ast> Visit<'ast> for Unsafety {
    fn visit_expr_unsafe(&mut self, _: &'ast syn::ExprUnsafe) {
        self.0 = true;
    }

    fn visit_signature(&mut self, signature: &'ast syn::Signature) {
        self.0 |= signature.unsafety.is_some();
        syn::visit::visit_signature(self, signature);
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        self.0 |= item.unsafety.is_some();
        syn::visit::visit_item_impl(self, item);
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.0 |= item.unsafety.is_some();
        syn::visit::visit_item_trait(self, item);
    }

    fn visit_item_foreign_mod(&mut self, item: &'ast syn::ItemForeignMod) {
        self.0 = true;
        syn::visit::visit_item_foreign_mod(self, item);
    }
}

fn parse(file: &str) -> syn::File {
    syn::parse_file(&read(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

#[test]
fn functions_do_not_grow_longer() {
    let mut all = Vec::new();
    for file in rust_files().into_iter().filter(|f| !is_test_file(f)) {
        let mut functions = Functions { file: file.clone(), ..Functions::default() };
        functions.visit_file(&parse(&file));
        all.extend(functions.found);
    }
    all.sort_by_key(|f| std::cmp::Reverse(f.2));
    let longest = all.first().map_or(0, |f| f.2);
    let over = all.iter().filter(|f| f.2 > FN_LINES_GOAL).count();
    let listing: Vec<String> = all
        .iter()
        .take_while(|f| f.2 > FN_LINES_GOAL)
        .map(|(at, name, lines)| format!("{lines:4} {name} {at}"))
        .collect();
    let listing = listing.join("\n");
    assert!(
        longest <= LONGEST_FN_LINES && over <= FNS_OVER_GOAL,
        "functions grew: the longest has {longest} lines (at most {LONGEST_FN_LINES}), {over} have more than \
         {FN_LINES_GOAL} (at most {FNS_OVER_GOAL}); split the new length up:\n{listing}"
    );
    assert!(
        longest == LONGEST_FN_LINES && over == FNS_OVER_GOAL,
        "functions got shorter: set LONGEST_FN_LINES to {longest} and FNS_OVER_GOAL to {over} in {}, so the gain \
         is kept",
        file!()
    );
}

#[test]
fn files_stay_under_the_length_limit() {
    let caps: BTreeMap<&str, usize> = LONG_FILES.iter().copied().collect();
    let mut problems = Vec::new();
    for file in rust_files() {
        let lines = read(&file).lines().count();
        match caps.get(file.as_str()) {
            Some(&cap) if lines > cap => problems.push(format!("{file}: {lines} lines, at most {cap}")),
            Some(_) if lines <= FILE_LINES_MAX => {
                problems.push(format!("{file}: {lines} lines: take it off LONG_FILES"));
            }
            None if lines > FILE_LINES_MAX => {
                problems.push(format!("{file}: {lines} lines, at most {FILE_LINES_MAX}"));
            }
            _ => {}
        }
    }
    for file in caps.keys() {
        if !root().join(file).exists() {
            problems.push(format!("{file}: listed in LONG_FILES, not there"));
        }
    }
    assert!(problems.is_empty(), "file lengths:\n{}", problems.join("\n"));
}

#[test]
fn unsafe_code_stays_in_the_files_allowed_it() {
    let allowed: std::collections::BTreeSet<&str> = UNSAFE_FILES.iter().copied().collect();
    let mut problems = Vec::new();
    for file in rust_files().into_iter().filter(|f| !is_test_file(f)) {
        let mut unsafety = Unsafety::default();
        unsafety.visit_file(&parse(&file));
        match (unsafety.0, allowed.contains(file.as_str())) {
            (true, false) => problems.push(format!("{file}: holds unsafe code and is not in UNSAFE_FILES")),
            (false, true) => problems.push(format!("{file}: holds no unsafe code: take it off UNSAFE_FILES")),
            _ => {}
        }
    }
    assert!(problems.is_empty(), "unsafe code:\n{}", problems.join("\n"));
}

/// Whether `line` names an issue by number or a later one.
fn names_history(line: &str) -> bool {
    let lower = line.to_lowercase();
    if lower.contains("later issue") || lower.contains("until later") {
        return true;
    }
    let mut rest = lower.as_str();
    while let Some(at) = rest.find("issue") {
        rest = &rest[at + "issue".len()..];
        let after = rest.trim_start_matches('s').trim_start().trim_start_matches(['\\', '[', '#']);
        if after.starts_with(|c: char| c.is_ascii_digit()) {
            return true;
        }
    }
    false
}

#[test]
fn code_and_docs_do_not_name_issues() {
    let mut files = rust_files();
    for dir in ["docs", "examples", "bench", "ffi", ".ci"] {
        files_under(&root().join(dir), &[".md", ".py", ".sh", ".toml", ".h", ".c"], &mut files);
    }
    files.push("README.md".into());
    let mut problems = Vec::new();
    // This file names what it looks for.
    for file in files.into_iter().filter(|f| f != file!()) {
        for (number, line) in read(&file).lines().enumerate() {
            if names_history(line) {
                problems.push(format!("{file}:{}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "code and docs speak of the system, not of its history (that goes to CHANGELOG.md):\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_history_check_finds_what_it_should() {
    for line in [
        "// placeholder until issue [3]",
        "//! (DESIGN §4; issue \\[7\\])",
        "// filled by later issues",
        "see issue #12",
    ] {
        assert!(names_history(line), "{line}");
    }
    for line in ["// highest priority first, until the device queue is full", "/// Ops issued per class", "issues"] {
        assert!(!names_history(line), "{line}");
    }
}

/// The name code uses for a dependency declared as `package`.
fn library_name(package: &str, declared: &toml::Value) -> String {
    let package = declared.get("package").and_then(toml::Value::as_str).unwrap_or(package);
    match package {
        "rust-s3" => "s3".into(),
        "lake-ffi" => "lake".into(),
        other => other.replace('-', "_"),
    }
}

/// What a parsed file names in code (paths, `use` trees, macros,
/// attributes, `extern crate`), each path as its first segment and as its
/// first two (`lake_dp` and `lake_dp::runner`); comments and docs do not
/// count.
#[derive(Default)]
struct Named(std::collections::BTreeSet<String>);

impl Named {
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }

    fn note(&mut self, first: String, second: Option<String>) {
        if let Some(second) = second {
            self.0.insert(format!("{first}::{second}"));
        }
        self.0.insert(first);
    }

    fn use_tree(&mut self, prefix: Option<&str>, tree: &syn::UseTree) {
        let mut name = |ident: &syn::Ident| match prefix {
            Some(first) => self.note(first.to_string(), Some(ident.to_string())),
            None => self.note(ident.to_string(), None),
        };
        match tree {
            syn::UseTree::Path(path) => {
                name(&path.ident);
                if prefix.is_none() {
                    self.use_tree(Some(&path.ident.to_string()), &path.tree);
                }
            }
            syn::UseTree::Name(syn::UseName { ident }) | syn::UseTree::Rename(syn::UseRename { ident, .. }) => {
                name(ident);
            }
            syn::UseTree::Group(group) => {
                for tree in &group.items {
                    self.use_tree(prefix, tree);
                }
            }
            syn::UseTree::Glob(_) => {}
        }
    }

    /// Paths inside tokens (a macro's, an attribute's): an identifier
    /// followed by `::`, with the identifier after it.
    fn tokens(&mut self, tokens: &[proc_macro2::TokenTree]) {
        use proc_macro2::TokenTree;
        let colon = |i: usize| matches!(tokens.get(i), Some(TokenTree::Punct(p)) if p.as_char() == ':');
        for (i, token) in tokens.iter().enumerate() {
            match token {
                TokenTree::Ident(ident) if colon(i + 1) => {
                    let second = match tokens.get(i + 3) {
                        Some(TokenTree::Ident(next)) if colon(i + 2) => Some(next.to_string()),
                        _ => None,
                    };
                    self.note(ident.to_string(), second);
                }
                TokenTree::Group(group) => {
                    let inner: Vec<TokenTree> = group.stream().into_iter().collect();
                    self.tokens(&inner);
                }
                _ => {}
            }
        }
    }
}

impl<'ast> Visit<'ast> for Named {
    fn visit_path(&mut self, path: &'ast syn::Path) {
        let mut segments = path.segments.iter().map(|s| s.ident.to_string());
        if let Some(first) = segments.next() {
            self.note(first, segments.next());
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(None, &item.tree);
    }

    fn visit_attribute(&mut self, attribute: &'ast syn::Attribute) {
        // `#[derive(clap::ValueEnum)]`, `#[serde(with = "...")]`: paths in
        // an attribute's tokens.
        if let syn::Meta::List(list) = &attribute.meta {
            let tokens: Vec<proc_macro2::TokenTree> = list.tokens.clone().into_iter().collect();
            self.tokens(&tokens);
        }
        syn::visit::visit_attribute(self, attribute);
    }

    fn visit_item_extern_crate(&mut self, item: &'ast syn::ItemExternCrate) {
        self.0.insert(item.ident.to_string());
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        // `format!("{}", x::y())`, a `vec![a::b(); n]`.
        let tokens: Vec<proc_macro2::TokenTree> = mac.tokens.clone().into_iter().collect();
        self.tokens(&tokens);
    }
}

#[test]
fn every_dependency_is_used() {
    let mut problems = Vec::new();
    for krate in CRATES {
        let manifest: toml::Table = read(&format!("{krate}/Cargo.toml")).parse().expect("a manifest");
        let mut sources = Vec::new();
        files_under(&root().join(krate), &[".rs"], &mut sources);
        let (mut in_code, mut in_tests) = (Named::default(), Named::default());
        for file in &sources {
            // The tests crate's own library and tools are its code.
            let test_code = is_test_file(file) && !(*krate == "tests" && file.starts_with("tests/src/"));
            let named = if test_code { &mut in_tests } else { &mut in_code };
            named.visit_file(&parse(file));
        }
        for (section, test_only) in [("dependencies", false), ("dev-dependencies", true), ("build-dependencies", false)]
        {
            let Some(table) = manifest.get(section).and_then(toml::Value::as_table) else { continue };
            for (package, declared) in table {
                let name = library_name(package, declared);
                let used = in_code.contains(&name) || (test_only && in_tests.contains(&name));
                if !used {
                    problems.push(format!("{krate}: {section}.{package} is never named in its code"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "unused dependencies:\n{}", problems.join("\n"));
}

/// The internal crates each library below the composition roots may depend
/// on (`[dependencies]`; tests may reach anything). A crate not listed
/// (`lake-cp`, `ffi`, `bench`, `tests`, `fuzz`) assembles the others.
const ARROWS: &[(&str, &[&str])] = &[
    ("lake-dp/core", &[]),
    ("lake-dp", &["lake-core"]),
    ("lake-cp/control", &["lake-core", "lake-dp"]),
    ("ffi/agent", &["lake-core", "lake-dp"]),
    ("kernels", &[]),
];

/// Where the manifests and the sources point that they must not.
fn wrong_arrows() -> Vec<String> {
    let mut problems = Vec::new();
    for (krate, allowed) in ARROWS {
        let manifest: toml::Table = read(&format!("{krate}/Cargo.toml")).parse().expect("a manifest");
        let Some(table) = manifest.get("dependencies").and_then(toml::Value::as_table) else { continue };
        for package in table.keys().filter(|p| p.starts_with("lake-")) {
            if !allowed.contains(&package.as_str()) {
                problems.push(format!("{krate}/Cargo.toml: depends on {package}"));
            }
        }
    }
    // The engine's side depends on `lake-dp` for the transport and the cp
    // link, never for its runner.
    for file in rust_files().into_iter().filter(|f| f.starts_with("ffi/") && !is_test_file(f)) {
        let mut named = Named::default();
        named.visit_file(&parse(&file));
        if named.contains("lake_dp::runner") {
            problems.push(format!("{file}: names the data plane's runner (lake_dp::runner)"));
        }
    }
    problems
}

#[test]
fn arrows_point_down() {
    let problems = wrong_arrows();
    assert!(problems.is_empty(), "arrows that should not exist:\n{}", problems.join("\n"));
}
