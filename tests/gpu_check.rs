//! The GPU check's CPU path: `bash scripts/gpu-check.sh cpu OUTDIR` with this build's graft
//! runs the whole pipeline (tiny plan) and writes every figure the GPU run writes, as
//! finite positive numbers, into one figures.jsonl.
//!
//! The transformers side needs `.graft-test-env/hf-bench` (torch + transformers, made by
//! scripts/bench-decode.sh; ~5 GB, not part of setup-test-env.sh): with it, its figures
//! must be there too; without it, the script must say it skipped them, part by part. The
//! trainer bench binary comes from a ship build (`bash scripts/gpu-check.sh pack`) when one
//! is there; without one, the script must say so. Timings are recorded, never asserted.
#![cfg(feature = "trainer")]
#![allow(clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use serde_json::Value;

/// `v[key]` as a number that is finite and above zero; names the figure when it is not.
fn positive(fig: &Value, key: &str) -> f64 {
    let x = fig[key].as_f64();
    match x {
        Some(x) if x.is_finite() && x > 0.0 => x,
        _ => panic!(
            "figure {fig} has {key} = {}, not a finite positive number",
            fig[key]
        ),
    }
}

fn of<'a>(figs: &'a [Value], what: &str) -> Vec<&'a Value> {
    figs.iter().filter(|f| f["what"] == what).collect()
}

fn skipped(figs: &[Value], part: &str) -> bool {
    of(figs, "skipped").iter().any(|f| f["part"] == part)
}

#[test]
fn gpu_check_cpu_path_writes_every_figure_kind() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let status = Command::new("bash")
        .arg(common::repo_root().join("scripts/gpu-check.sh"))
        .arg("cpu")
        .arg(out.path())
        .env("GRAFT_GPU_CHECK_GRAFT", common::graft_bin())
        .status()?;
    let text = std::fs::read_to_string(out.path().join("figures.jsonl"))?;
    let figs: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert!(
        status.success(),
        "gpu-check.sh cpu exited {status}; figures:\n{text}"
    );
    assert!(
        figs.iter().all(|f| f["what"].is_string()),
        "a line without 'what':\n{text}"
    );
    let failed: Vec<&Value> = of(&figs, "part")
        .into_iter()
        .filter(|p| p["status"] != "ok" && p["status"] != "skipped")
        .collect();
    assert!(failed.is_empty(), "parts that failed: {failed:?}");
    let kinds: BTreeSet<&str> = figs.iter().filter_map(|f| f["what"].as_str()).collect();
    for k in [
        "run",
        "host",
        "build",
        "part",
        "weights",
        "serve_start",
        "decode",
        "decode_summary",
        "engine_info",
        "weight_push",
        "run_end",
    ] {
        assert!(kinds.contains(k), "no '{k}' figure; kinds: {kinds:?}");
    }
    let run = of(&figs, "run")[0];
    let hf = run["hf_python"] == true;
    let bench = run["bench"] == true;

    // graft serve: decode tok/s for every batch, the engine's report, two pushes that land.
    let batches: Vec<i64> = run["serve"]["batches"]
        .as_str()
        .unwrap_or_default()
        .split(',')
        .filter_map(|b| b.parse().ok())
        .collect();
    assert!(!batches.is_empty(), "the run line names no batches: {run}");
    positive(of(&figs, "weights")[0], "bytes");
    positive(of(&figs, "serve_start")[0], "start_s");
    for b in &batches {
        let graft: Vec<&Value> = of(&figs, "decode")
            .into_iter()
            .filter(|d| d["side"] == "graft" && d["batch"] == *b)
            .collect();
        assert!(!graft.is_empty(), "no graft decode figure at batch {b}");
        for d in graft {
            positive(d, "tok_s");
            positive(d, "t1_s");
        }
        let summary = of(&figs, "decode_summary")
            .into_iter()
            .find(|s| s["batch"] == *b)
            .unwrap_or_else(|| panic!("no decode_summary at batch {b}"));
        positive(summary, "graft_tok_s");
        if hf {
            positive(summary, "hf_tok_s");
            positive(summary, "graft_over_hf");
        }
    }
    assert!(
        of(&figs, "engine_info")
            .iter()
            .any(|e| e["status"] == 200 && e["body"].is_object()),
        "no engine_info answered 200 with a JSON object: {:?}",
        of(&figs, "engine_info")
    );
    let pushes = of(&figs, "weight_push");
    assert_eq!(pushes.len(), 2, "two pushes: {pushes:?}");
    for p in &pushes {
        assert_eq!(p["version_ok"], true, "{p}");
        assert_eq!(p["changed"], true, "{p}");
        positive(p, "push_s");
        positive(&p["seconds"], "update_weights_from_disk");
    }
    positive(pushes[0], "write_s");

    // The trainer bench, when a bench binary was there.
    if bench {
        let t = of(&figs, "trainer_bench");
        assert_eq!(t.len(), 1, "one trainer_bench figure (tiny): {t:?}");
        positive(t[0], "tokens_s");
        for k in [
            "step_s",
            "bare_fwd_bwd_s",
            "sample_tokens_s",
            "per_step_path_s",
        ] {
            positive(&t[0]["table"], k);
        }
    } else {
        assert!(
            skipped(&figs, "trainer_bench tiny"),
            "no bench and no skip line"
        );
    }

    // transformers' side, when its Python was there.
    if hf {
        positive(of(&figs, "matmul_peak")[0], "tflops");
        let h = of(&figs, "hf_train");
        assert_eq!(h.len(), 1, "one hf_train figure: {h:?}");
        positive(h[0], "tokens_s");
        positive(h[0], "peak_rss_gib");
        let lp = of(&figs, "logprob_agreement");
        assert_eq!(lp.len(), 1, "{lp:?}");
        for side in ["vs_hf_bf16", "vs_hf_fp32", "floor_hf_bf16_vs_fp32"] {
            let agree = lp[0][side]["argmax_agree"].as_f64().unwrap_or(-1.0);
            assert!((0.0..=1.0).contains(&agree), "{side}: {}", lp[0]);
            let max_abs = lp[0][side]["max_abs"].as_f64().unwrap_or(f64::NAN);
            assert!(max_abs.is_finite() && max_abs >= 0.0, "{side}: {}", lp[0]);
        }
        // On the CPU both sides compute in fp32: graft's logprobs are transformers' fp32 ones.
        let fp32 = lp[0]["vs_hf_fp32"]["max_abs"].as_f64().unwrap_or(f64::NAN);
        assert!(
            fp32 < 1e-3,
            "graft vs transformers fp32 on the CPU: {}",
            lp[0]
        );
        let after = pushes[0]["after_vs_hf"]["max_abs"]
            .as_f64()
            .unwrap_or(f64::NAN);
        assert!(
            after < 1e-3,
            "graft after the push vs transformers on the pushed weights: {}",
            pushes[0]
        );
        if bench {
            positive(of(&figs, "train_compare")[0], "graft_over_hf");
        }
    } else {
        for part in [
            "matmul_peak",
            "hf_train tiny",
            "serve.logprob_agreement",
            "serve.decode.hf",
        ] {
            assert!(
                skipped(&figs, part),
                "no transformers Python and no skip line for {part}"
            );
        }
    }
    let end = of(&figs, "run_end")[0];
    assert_eq!(end["failed"], serde_json::json!([]), "{end}");
    Ok(())
}
