//! The workspace's shape, checked against `cargo metadata`:
//! (a) the workspace crates' normal dependencies on each other are exactly the edges of the
//!     Workspace table in `docs/ARCHITECTURE.md` ("may depend on"), no more, no fewer;
//! (b) the default `graft` build (default features) does not contain the scripted upstream
//!     (`graft-testkit`), not even through another crate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The host's target triple (`rustc -vV`), so `cargo metadata` reads only the packages this
/// platform builds (and needs none it has not downloaded).
fn host() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let out = Command::new(rustc)
        .arg("-vV")
        .current_dir(root())
        .output()
        .expect("rustc -vV runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names the host")
        .trim()
        .to_owned()
}

/// `cargo metadata` of the workspace, default features (what `cargo build` builds).
fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--offline",
            "--filter-platform",
        ])
        .arg(host())
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON")
}

/// A workspace package: its name and its folder relative to the workspace root ("" for the
/// root package).
struct Member {
    name: String,
    dir: String,
    package: Value,
}

fn members(meta: &Value) -> Vec<Member> {
    let ws_root = PathBuf::from(meta["workspace_root"].as_str().expect("workspace_root"));
    let ids: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| p["id"].as_str().is_some_and(|id| ids.contains(id)))
        .map(|p| {
            let manifest = PathBuf::from(p["manifest_path"].as_str().expect("manifest_path"));
            let dir = manifest
                .parent()
                .and_then(|d| d.strip_prefix(&ws_root).ok())
                .map(|d| d.to_string_lossy().replace('\\', "/"))
                .expect("a member lives under the workspace root");
            Member {
                name: p["name"].as_str().expect("name").to_owned(),
                dir,
                package: p.clone(),
            }
        })
        .collect()
}

/// The edges as built: each member's normal (not dev, not build) dependencies on other
/// members, optional ones included.
fn real_edges(members: &[Member]) -> BTreeMap<String, BTreeSet<String>> {
    let names: BTreeSet<&str> = members.iter().map(|m| m.name.as_str()).collect();
    members
        .iter()
        .map(|m| {
            let deps = m.package["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].is_null())
                .filter_map(|d| d["name"].as_str())
                .filter(|n| names.contains(n))
                .map(str::to_owned)
                .collect();
            (m.name.clone(), deps)
        })
        .collect()
}

/// The rows of the "## Workspace" table: first cell, last cell.
fn table_rows(doc: &str) -> Vec<(String, String)> {
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Workspace"))
        .expect("docs/ARCHITECTURE.md has a '## Workspace' section");
    section
        .lines()
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect::<Vec<_>>()
        })
        .filter(|cells| cells.len() >= 3 && !cells[0].starts_with("---") && cells[0] != "path")
        .map(|cells| (cells[0].clone(), cells[cells.len() - 1].clone()))
        .collect()
}

/// The backticked names in a cell.
fn ticked(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// A "may depend on" cell as crate names: comma-separated short names (`recorder` →
/// `graft-recorder`), parenthesised remarks and "—" ignored.
fn allowed(cell: &str) -> BTreeSet<String> {
    let mut plain = String::new();
    let mut depth = 0;
    for ch in cell.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            c if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    plain
        .split(',')
        .map(|s| s.trim().trim_matches('`'))
        .filter(|s| !s.is_empty() && *s != "—")
        .map(|s| format!("graft-{s}"))
        .collect()
}

/// The table's edges, per member: the row whose first cell names the member's folder
/// (`` `wire/` ``; the root package's row names `` `Cargo.toml` ``).
fn documented_edges(members: &[Member], doc: &str) -> BTreeMap<String, BTreeSet<String>> {
    let rows = table_rows(doc);
    members
        .iter()
        .map(|m| {
            let key = if m.dir.is_empty() {
                "Cargo.toml".to_owned()
            } else {
                format!("{}/", m.dir)
            };
            let matching: Vec<&(String, String)> = rows
                .iter()
                .filter(|(path, _)| ticked(path).contains(&key.as_str()))
                .collect();
            assert_eq!(
                matching.len(),
                1,
                "the Workspace table of docs/ARCHITECTURE.md needs exactly one row for `{key}` ({})",
                m.name
            );
            (m.name.clone(), allowed(&matching[0].1))
        })
        .collect()
}

#[test]
fn crate_edges_are_exactly_the_documented_ones() {
    let meta = metadata();
    let members = members(&meta);
    assert!(
        members.len() >= 8,
        "expected the workspace's crates, found {}",
        members.len()
    );
    let doc = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).expect("the doc");
    let real = real_edges(&members);
    let documented = documented_edges(&members, &doc);
    let names: BTreeSet<String> = members.iter().map(|m| m.name.clone()).collect();
    let mut problems = vec![];
    for (krate, deps) in &real {
        let want = &documented[krate];
        for unknown in want.difference(&names) {
            problems.push(format!(
                "{krate}: the table names '{unknown}', which is no workspace crate"
            ));
        }
        for extra in deps.difference(want) {
            problems.push(format!(
                "{krate} depends on {extra}, which the table does not allow"
            ));
        }
        for missing in want.intersection(&names).filter(|w| !deps.contains(*w)) {
            problems.push(format!(
                "the table says {krate} depends on {missing}, but it does not"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/ARCHITECTURE.md's Workspace table and Cargo.toml disagree:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_table_parser_reads_names_and_ignores_remarks() {
    // The test above is only as good as this reading of the "may depend on" cells.
    assert_eq!(allowed("— (leaf)"), BTreeSet::new());
    assert_eq!(
        allowed("recorder, reconstruct, wire"),
        ["graft-recorder", "graft-reconstruct", "graft-wire"]
            .map(String::from)
            .into()
    );
    assert_eq!(
        allowed("envd-agent (reaches the gateway over HTTP only, not a crate edge)"),
        ["graft-envd-agent".to_owned()].into()
    );
    assert_eq!(ticked("`Cargo.toml`, `src/`"), vec!["Cargo.toml", "src/"]);
}

#[test]
fn the_default_graft_build_has_no_scripted_upstream() {
    let meta = metadata();
    let nodes = meta["resolve"]["nodes"].as_array().expect("resolve.nodes");
    let name_of = |id: &str| -> String {
        meta["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .find(|p| p["id"] == id)
            .and_then(|p| p["name"].as_str())
            .unwrap_or(id)
            .to_owned()
    };
    let graft_id = meta["resolve"]["root"]
        .as_str()
        .map(str::to_owned)
        .or_else(|| {
            nodes
                .iter()
                .filter_map(|n| n["id"].as_str())
                .find(|id| name_of(id) == "graft")
                .map(str::to_owned)
        })
        .expect("the graft package in the resolve graph");
    assert_eq!(name_of(&graft_id), "graft");
    let node = |id: &str| nodes.iter().find(|n| n["id"] == id);
    let graft = node(&graft_id).expect("graft's node");
    let features: Vec<&str> = graft["features"]
        .as_array()
        .expect("features")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        !features.contains(&"testkit"),
        "the default graft build turns on the 'testkit' feature: {features:?}"
    );
    // Everything the default build links: normal and build dependencies, transitively.
    let mut seen = BTreeSet::new();
    let mut todo = vec![graft_id.clone()];
    while let Some(id) = todo.pop() {
        if !seen.insert(id.clone()) {
            continue;
        }
        let Some(n) = node(&id) else { continue };
        for d in n["deps"].as_array().into_iter().flatten() {
            let linked = d["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null() || k["kind"] == "build");
            if linked && let Some(pkg) = d["pkg"].as_str() {
                todo.push(pkg.to_owned());
            }
        }
    }
    let linked: BTreeSet<String> = seen.iter().map(|id| name_of(id)).collect();
    assert!(
        linked.contains("graft-gateway"),
        "the walk reaches graft's dependencies: {linked:?}"
    );
    assert!(
        !linked.contains("graft-testkit"),
        "the default graft build contains graft-testkit; it must stay an optional dependency behind the non-default 'testkit' feature"
    );
    // And the manifest says so.
    let graft_pkg = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .find(|p| p["id"] == graft_id.as_str())
        .expect("graft's package");
    let dep = graft_pkg["dependencies"]
        .as_array()
        .expect("dependencies")
        .iter()
        .find(|d| d["name"] == "graft-testkit" && d["kind"].is_null())
        .expect("graft has graft-testkit as a (feature-gated) dependency");
    assert_eq!(dep["optional"], true, "graft-testkit must be optional");
}
