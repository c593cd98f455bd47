//! `graft serve` on the trainer's tiny Qwen3 fixture, driven over HTTP: `/generate`
//! answers what the model computes (JSON and streamed), concurrent requests, and the weight
//! push round trip: after `graft train`-style weights are pushed, the server reports the
//! new weight_version and its logprobs for a fixed prompt equal the trainer's.
#![cfg(feature = "trainer")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use graft_trainer::generate;
use graft_trainer::model::Model;
use graft_trainer::push::{self, ServerUrl};
use graft_trainer::tch::{Device, Kind, Tensor};
use graft_trainer::weights;
use serde_json::{Value, json};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("trainer/tests/fixtures/models/qwen3")
}

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> anyhow::Result<Server> {
    start_with(&fixture())
}

fn start_with(model: &Path) -> anyhow::Result<Server> {
    start_args(model, &[])
}

fn start_args(model: &Path, extra: &[&str]) -> anyhow::Result<Server> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(["serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(model)
        .args(extra)
        .env("GRAFT_DEVICE", "cpu")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .ok_or_else(|| anyhow::anyhow!("graft serve printed '{line}'"))?
        .to_owned();
    Ok(Server { child, url })
}

fn post(url: &str, path: &str, body: Value) -> anyhow::Result<(u16, String)> {
    let u = ServerUrl::parse(url)?;
    let r = push::post_json(&u, path, &body, Duration::from_secs(60))?;
    Ok((r.status, r.body))
}

fn local_model(dir: &Path) -> anyhow::Result<Model> {
    graft_trainer::device::init();
    Ok(Model::load(dir, Device::Cpu, Kind::Float)?)
}

#[test]
fn generate_answers_what_the_model_computes() -> anyhow::Result<()> {
    let server = start()?;
    let model = local_model(&fixture())?;
    let prompt = vec![1i64, 20, 33, 7];
    let want = generate::sample(&model, std::slice::from_ref(&prompt), 6, 0.0)?;
    let body = json!({"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": true}, "return_logprob": true});
    let (status, text) = post(&server.url, "/generate", body.clone())?;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text)?;
    let ids: Vec<i64> = serde_json::from_value(v["output_ids"].clone())?;
    assert_eq!(ids, want[0].tokens);
    let meta = &v["meta_info"];
    assert_eq!(meta["finish_reason"]["type"], "length");
    assert_eq!(meta["prompt_tokens"], 4);
    assert_eq!(meta["completion_tokens"], 6);
    assert_eq!(meta["weight_version"], "default");
    let lps = meta["output_token_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(lps.len(), 6);
    for (e, (id, lp)) in lps.iter().zip(want[0].tokens.iter().zip(&want[0].logprobs)) {
        assert_eq!(e[1].as_i64(), Some(*id));
        assert!((e[0].as_f64().unwrap_or(f64::NAN) - f64::from(*lp)).abs() < 1e-4);
    }

    // Streamed: cumulative events, the last with the finish reason, then [DONE].
    let mut stream = body;
    stream["stream"] = json!(true);
    let (status, text) = post(&server.url, "/generate", stream)?;
    assert_eq!(status, 200);
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let last: Value = serde_json::from_str(events[events.len() - 2])?;
    assert_eq!(last["output_ids"], json!(want[0].tokens));
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    assert!(events.len() >= 7, "one event per token: {events:?}");

    // Concurrent requests all get their own answer.
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let url = server.url.clone();
            std::thread::spawn(move || {
                post(&url, "/generate", json!({"input_ids": [1, 2 + i, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": true}}))
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, text) = h.join().map_err(|_| anyhow::anyhow!("thread"))??;
        assert_eq!(status, 200);
        let v: Value = serde_json::from_str(&text)?;
        let alone = generate::sample(&model, &[vec![1, 2 + i as i64, 3]], 5, 0.0)?;
        assert_eq!(v["output_ids"], json!(alone[0].tokens));
    }
    let (status, text) = post(&server.url, "/generate", json!({"sampling_params": {}}))?;
    assert_eq!(status, 400);
    assert!(text.contains("input_ids"), "{text}");
    Ok(())
}

/// `logit_bias` changes what is sampled and the logprobs are those of the biased
/// distribution; a seed repeats a sampled answer; parameters graft serve does not
/// implement, or out of SGLang's ranges, are refused by name; a `rid` names the answer and
/// `/abort_request` stops it.
/// Issue 35, point 10: a `sampling_params` key SGLang 0.5.23 does not read is refused as
/// SGLang refuses it: 400 `{"error": "unknown field ..."}` with its contract's text (which
/// `tests/conformance.rs` checks against the installed SGLang), before anything else.
#[test]
fn point10_graft_serve_refuses_unknown_sampling_keys_as_sglang_does() -> anyhow::Result<()> {
    let server = start()?;
    for sp in [
        json!({"temperature": 0.0, "graft_bogus": 1}),
        // A key other servers take (vLLM's `min_tokens`) is not SGLang's.
        json!({"max_new_tokens": 2, "min_tokens": 1}),
    ] {
        let body = json!({"input_ids": [1, 2, 3], "sampling_params": sp});
        let (status, text) = post(&server.url, "/generate", body.clone())?;
        assert_eq!(status, 400, "{sp}: {text}");
        let want = graft_wire::sglang::sampling_params_contract_error(&body)
            .ok_or_else(|| anyhow::anyhow!("no contract error for {sp}"))?;
        assert_eq!(
            serde_json::from_str::<Value>(&text)?,
            json!({"error": want})
        );
    }
    // Every key SGLang reads is still taken (or refused by name for what graft serve does
    // not implement, as before).
    let (status, text) = post(
        &server.url,
        "/generate",
        json!({"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 2,
            "ignore_eos": true, "no_stop_trim": true, "skip_special_tokens": false}}),
    )?;
    assert_eq!(status, 200, "{text}");
    Ok(())
}

/// A body past `--max-body-bytes` is answered 413 naming the limit, not read whole; the
/// server goes on answering.
#[test]
fn an_oversized_body_is_refused_with_413_and_the_server_stays_up() -> anyhow::Result<()> {
    let server = start_args(&fixture(), &["--max-body-bytes", "4096"])?;
    let ids: Vec<u32> = (0..2000).map(|i| i % 50).collect();
    let (status, text) = post(
        &server.url,
        "/generate",
        json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}),
    )?;
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("4096 bytes"), "{text}");
    let (status, text) = post(
        &server.url,
        "/generate",
        json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
    )?;
    assert_eq!(status, 200, "{text}");
    Ok(())
}

#[test]
fn logit_bias_is_honoured_other_parameters_refused_and_rid_aborts() -> anyhow::Result<()> {
    let server = start()?;
    let model = local_model(&fixture())?;
    let prompt = vec![1i64, 20, 33, 7];
    let greedy = generate::sample(&model, std::slice::from_ref(&prompt), 3, 0.0)?;
    let first = greedy[0].tokens[0];
    let generate_with = |sp: Value| -> anyhow::Result<Value> {
        let (status, text) = post(
            &server.url,
            "/generate",
            json!({"input_ids": prompt, "sampling_params": sp, "return_logprob": true}),
        )?;
        anyhow::ensure!(status == 200, "{status}: {text}");
        Ok(serde_json::from_str(&text)?)
    };
    // Banning the greedy first token moves greedy decoding off it.
    let banned = generate_with(
        json!({"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": true,
        "logit_bias": {first.to_string(): -100.0}}),
    )?;
    assert_ne!(banned["output_ids"][0], json!(first), "{banned}");
    // A large positive bias makes a chosen token all but certain, at any temperature, and
    // its logprob (the biased distribution's) is about 0.
    let chosen = (first + 1) % 64;
    let forced = generate_with(
        json!({"temperature": 1.0, "max_new_tokens": 1, "ignore_eos": true,
        "logit_bias": {chosen.to_string(): 100.0}}),
    )?;
    assert_eq!(forced["output_ids"], json!([chosen]), "{forced}");
    let lp = forced["meta_info"]["output_token_logprobs"][0][0]
        .as_f64()
        .unwrap_or(f64::NAN);
    assert!(lp > -1e-3, "logprob of the forced token: {lp}");
    // Without a bias nothing changed.
    let plain =
        generate_with(json!({"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": true}))?;
    assert_eq!(plain["output_ids"], json!(greedy[0].tokens));
    // Refused by name: what would change the sampling and is not implemented; a bad bias.
    for (sp, says) in [
        (
            json!({"min_new_tokens": 3, "n": 2}),
            "min_new_tokens = 3, n = 2",
        ),
        (
            json!({"repetition_penalty": 3.0}),
            "repetition_penalty must be in [0, 2], got 3",
        ),
        (
            json!({"frequency_penalty": -2.5}),
            "frequency_penalty must be in [-2, 2], got -2.5",
        ),
        (json!({"regex": "a+"}), "regex"),
        (json!({"logit_bias": {"x": 1}}), "'x' is not one"),
        (
            json!({"logit_bias": {"999999": 1}}),
            "outside the vocabulary",
        ),
        (json!({"min_p": 2.0}), "min_p must lie in [0, 1]"),
        // A wrong type is blamed on the sampling parameters, not on the prompt.
        (
            json!({"max_new_tokens": -1}),
            "'sampling_params' does not fit",
        ),
        (
            json!({"temperature": "hot"}),
            "'sampling_params' does not fit",
        ),
    ] {
        let (status, text) = post(
            &server.url,
            "/generate",
            json!({"input_ids": prompt, "sampling_params": sp}),
        )?;
        assert_eq!(status, 400, "{sp}: {text}");
        assert!(text.contains(says), "{sp}: {text}");
    }
    // An id the model has no embedding for is refused before it reaches the batch.
    let (status, text) = post(
        &server.url,
        "/generate",
        json!({"input_ids": [1, 999999], "sampling_params": {}}),
    )?;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("outside the model's vocabulary"), "{text}");
    let (status, text) = post(
        &server.url,
        "/generate",
        json!({"input_ids": [1, -5], "sampling_params": {}}),
    )?;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("'input_ids' holds -5"), "{text}");
    // Neutral values of those parameters are fine.
    generate_with(
        json!({"repetition_penalty": 1.0, "presence_penalty": 0.0, "n": 1, "max_new_tokens": 2}),
    )?;
    // A seed makes a sampled answer repeatable, penalties included.
    let seeded = json!({"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": true,
        "sampling_seed": 1234, "repetition_penalty": 1.3, "frequency_penalty": 0.5});
    let a = generate_with(seeded.clone())?;
    let b = generate_with(seeded)?;
    assert_eq!(a["output_ids"], b["output_ids"], "{a} vs {b}");
    assert_eq!(
        a["meta_info"]["output_token_logprobs"],
        b["meta_info"]["output_token_logprobs"]
    );

    // A long generation with a rid: its id names the answer; aborting it by rid ends it.
    let url = server.url.clone();
    let long = std::thread::spawn(move || {
        post(
            &url,
            "/generate",
            json!({"input_ids": [1, 2, 3], "rid": "rollout-7/call-3",
                "sampling_params": {"max_new_tokens": 100000, "ignore_eos": true}}),
        )
    });
    let mut aborted = 0;
    for _ in 0..200 {
        let (status, text) = post(
            &server.url,
            "/abort_request",
            json!({"rid": "rollout-7/call-3"}),
        )?;
        assert_eq!(status, 200, "{text}");
        aborted = serde_json::from_str::<Value>(&text)?["aborted"]
            .as_u64()
            .unwrap_or(0);
        if aborted == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(aborted, 1, "the running request was found by its rid");
    let (status, text) = long.join().map_err(|_| anyhow::anyhow!("thread"))??;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text)?;
    assert_eq!(v["meta_info"]["id"], "rollout-7/call-3");
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "abort", "{v}");
    let n = v["output_ids"].as_array().map_or(0, Vec::len);
    assert!(n < 100000, "stopped early: {n} tokens");
    // Once it ended, the rid is free again and names nothing to abort.
    let (_, text) = post(
        &server.url,
        "/abort_request",
        json!({"rid": "rollout-7/call-3"}),
    )?;
    assert_eq!(serde_json::from_str::<Value>(&text)?["aborted"], 0);
    let (status, _) = post(&server.url, "/abort_request", json!({}))?;
    assert_eq!(status, 400);
    Ok(())
}

/// A weight update lands while a streamed request is generating: nothing waits for the
/// request to end; its stream stays whole (cumulative events, a finish reason, `[DONE]`);
/// its tokens before the update are the old weights' greedy continuation with their
/// logprobs, those after the new weights' continuation of that prefix with theirs; and the
/// answer says so per span (`meta_info.weight_versions`).
#[test]
fn an_update_mid_stream_keeps_the_stream_and_labels_each_token_with_its_weights()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let newer = tmp.path().join("newer");
    let m = local_model(&fixture())?;
    let params: Vec<(String, Tensor)> = m
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.detach() * 1.3))
        .collect();
    weights::write_dir(&newer, m.raw_config(), &params, Kind::Float, usize::MAX)?;
    let new_model = local_model(&newer)?;
    let server = start()?;
    let prompt = vec![11i64, 12, 13];
    let n = 240;
    let rt = tokio::runtime::Runtime::new()?;
    let (ids, logprobs, last) = rt.block_on(async {
        let body = json!({"input_ids": prompt, "stream": true, "return_logprob": true,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": true}});
        let resp = common::http::post_stream(&format!("{}/generate", server.url), &body).await;
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut buf = String::new();
        let mut events = Vec::new();
        // Three tokens in, the update goes to the server beside the stream.
        while events.len() < 3 {
            let d = common::http::next_sse_data(&mut body, &mut buf)
                .await
                .expect("the stream ended early");
            events.push(d);
        }
        let url = server.url.clone();
        let newer = newer.display().to_string();
        let update = tokio::task::spawn_blocking(move || {
            post(
                &url,
                "/update_weights_from_disk",
                json!({"model_path": newer, "weight_version": "v1"}),
            )
        });
        while let Some(d) = common::http::next_sse_data(&mut body, &mut buf).await {
            if d == "[DONE]" {
                break;
            }
            events.push(d);
        }
        let (status, text) = update.await??;
        assert_eq!(status, 200, "{text}");
        let last: Value = serde_json::from_str(events.last().expect("events"))?;
        // Events are cumulative: each one's ids extend the one before.
        let mut prev: Vec<i64> = Vec::new();
        for e in &events {
            let v: Value = serde_json::from_str(e)?;
            let ids: Vec<i64> = serde_json::from_value(v["output_ids"].clone())?;
            assert!(ids.starts_with(&prev), "events are cumulative");
            prev = ids;
        }
        let ids: Vec<i64> = serde_json::from_value(last["output_ids"].clone())?;
        let logprobs: Vec<f64> = last["meta_info"]["output_token_logprobs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|t| t[0].as_f64().unwrap_or(f64::NAN))
                    .collect()
            })
            .unwrap_or_default();
        anyhow::Ok((ids, logprobs, last))
    })?;
    assert_eq!(ids.len(), n, "the request ran to its end");
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(last["meta_info"]["weight_version"], "v1");
    let spans = last["meta_info"]["weight_versions"].clone();
    let k = spans[0]["end"].as_u64().unwrap_or(0) as usize;
    assert_eq!(
        spans,
        json!([{"version": "default", "start": 0, "end": k}, {"version": "v1", "start": k, "end": n}]),
        "two spans: the update landed mid-request"
    );
    assert!((3..n).contains(&k), "{spans}");
    // Before the update: the old weights' own tokens and logprobs.
    let old = generate::sample(&m, std::slice::from_ref(&prompt), k, 0.0)?;
    assert_eq!(ids[..k], old[0].tokens[..]);
    for (a, b) in logprobs[..k].iter().zip(&old[0].logprobs) {
        assert!((a - f64::from(*b)).abs() < 1e-4, "{a} vs {b}");
    }
    // After it: the new weights continuing that very prefix, with their logprobs.
    let mut prefix = prompt.clone();
    prefix.extend(&ids[..k]);
    let cont = generate::sample(&new_model, &[prefix], n - k, 0.0)?;
    assert_eq!(ids[k..], cont[0].tokens[..]);
    for (a, b) in logprobs[k..].iter().zip(&cont[0].logprobs) {
        assert!((a - f64::from(*b)).abs() < 1e-4, "{a} vs {b}");
    }
    Ok(())
}

#[test]
fn weight_push_round_trip() -> anyhow::Result<()> {
    let server = start()?;
    // New weights, written as the trainer writes them.
    let tmp = tempfile::tempdir()?;
    let base = local_model(&fixture())?;
    let params: Vec<(String, Tensor)> = base
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.detach() * 0.8))
        .collect();
    let dir = tmp.path().join("step-7");
    weights::write_dir(&dir, base.raw_config(), &params, Kind::Float, usize::MAX)?;
    push::push_weights(&server.url, &dir, "step-7", None)?;
    let (_, info) = post(&server.url, "/get_model_info", json!({}))?;
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(info["weight_version"], "step-7");
    // The server's logprobs for a fixed prompt + continuation equal the trainer's.
    let trained = local_model(&dir)?;
    let prompt = vec![1i64, 9, 9, 4];
    let body = json!({"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": true}, "return_logprob": true});
    let (_, text) = post(&server.url, "/generate", body)?;
    let v: Value = serde_json::from_str(&text)?;
    assert_eq!(v["meta_info"]["weight_version"], "step-7");
    let ids: Vec<i64> = serde_json::from_value(v["output_ids"].clone())?;
    let mut seq = prompt.clone();
    seq.extend(&ids);
    let lp = graft_trainer::grpo::token_logprobs(
        &trained,
        &Tensor::from_slice(&seq).unsqueeze(0),
        1.0,
        64,
    )?;
    let lp: Vec<f32> = Vec::try_from(lp.squeeze_dim(0).narrow(
        0,
        prompt.len() as i64,
        ids.len() as i64,
    ))?;
    let served = v["meta_info"]["output_token_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(served.len(), lp.len());
    for (e, l) in served.iter().zip(&lp) {
        let s = e[0].as_f64().unwrap_or(f64::NAN);
        assert!(
            (s - f64::from(*l)).abs() < 1e-4,
            "served {s} vs trainer {l}"
        );
    }
    Ok(())
}

/// The fixture plus a word-level tokenizer.json ("w000" … "w159", split on spaces), so
/// `text` prompts, decoded `text` answers and stop strings can be checked exactly.
fn with_tokenizer(dir: &Path) -> anyhow::Result<()> {
    for e in std::fs::read_dir(fixture())? {
        let e = e?;
        std::fs::copy(e.path(), dir.join(e.file_name()))?;
    }
    let vocab: serde_json::Map<String, Value> =
        (0..160).map(|i| (format!("w{i:03}"), json!(i))).collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w000"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string())?;
    Ok(())
}

fn words(ids: &[i64]) -> String {
    ids.iter()
        .map(|i| format!("w{i:03}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn text_prompts_decoded_answers_and_stop_strings() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    with_tokenizer(tmp.path())?;
    let server = start_with(tmp.path())?;
    let model = local_model(&fixture())?;
    let prompt = vec![1i64, 20, 33, 7];
    let want = generate::sample(&model, std::slice::from_ref(&prompt), 8, 0.0)?[0]
        .tokens
        .clone();
    let body = json!({"text": words(&prompt), "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": true}});
    let (status, text) = post(&server.url, "/generate", body)?;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text)?;
    assert_eq!(v["output_ids"], json!(want));
    assert_eq!(v["text"], json!(words(&want)));
    assert_eq!(v["meta_info"]["prompt_tokens"], 4);

    // A stop string ends the answer at its first occurrence (kept in the output).
    let stop = format!("w{:03}", want[3]);
    let first = want.iter().position(|&t| t == want[3]).unwrap_or(3);
    let body = json!({"text": words(&prompt), "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": true, "stop": [stop]}});
    let (_, text) = post(&server.url, "/generate", body)?;
    let v: Value = serde_json::from_str(&text)?;
    assert_eq!(v["output_ids"], json!(want[..=first]), "{text}");
    assert_eq!(
        v["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": stop})
    );
    Ok(())
}

/// A real pretrained model through the whole path: SmolLM2's GGUF (scripts/setup-models.sh)
/// imported by `graft model import` (bf16, with its tokenizer and chat template), served by
/// `graft serve`, asked in text.
#[test]
fn imported_smollm2_answers_text_through_graft_serve() -> anyhow::Result<()> {
    let env = std::env::var_os("GRAFT_TEST_ENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".graft-test-env"));
    let gguf = env.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} is missing: run `bash scripts/setup-models.sh`",
        gguf.display()
    );
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("smollm2");
    let import = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(["model", "import", "--dtype", "bf16", "--gguf"])
        .arg(&gguf)
        .arg("--out")
        .arg(&dir)
        .output()?;
    assert!(
        import.status.success(),
        "{}",
        String::from_utf8_lossy(&import.stderr)
    );
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(dir.join(f).exists(), "{f} was not written");
    }
    let server = start_with(&dir)?;
    let body = json!({"text": "The capital of France is", "sampling_params": {"temperature": 0.0, "max_new_tokens": 3}});
    let (status, text) = post(&server.url, "/generate", body)?;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text)?;
    let answer = v["text"].as_str().unwrap_or_default();
    assert!(answer.starts_with(" Paris"), "SmolLM2 answered {answer:?}");
    Ok(())
}
