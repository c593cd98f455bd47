//! Issue 35, point 10: stand-ins that cannot drift. Every body graft sends to an inference
//! server is checked against that server's own request models, read from the pinned
//! `sglang` and `vllm` packages at test time (`tests/conformance/check_bodies.py`; the
//! packages' files come from `bash scripts/setup-test-env.sh`, part `servers`), and the
//! scripted upstream refuses what SGLang 0.5.23 refuses, in SGLang's own words.
//!
//! - `point10_every_body_graft_sends_to_sglang_fits_sglangs_own_models`: exact mode driven
//!   over chat and completions, whole and streamed, every sampling key graft maps, tools, an
//!   abandoned stream (graft's `/abort_request`), then the trainer's weight push (pause,
//!   flush, `update_weights_from_disk`, continue); every body the scripted SGLang side
//!   received is judged by SGLang's generated contract (`api_types.GenerateRequest`) or the
//!   route's `io_struct` model. A planted unknown sampling key fails the same check with
//!   SGLang's message, and the scripted upstream refuses it with that very message.
//! - `point10_scripted_upstream_takes_tensor_updates_only_inside_a_weight_update_session`:
//!   `/update_weights_from_tensor` outside `/begin_weight_update` … `/end_weight_update` is
//!   refused as SGLang 0.5.23 refuses it (its message read from its source).
//! - `point10_every_body_graft_sends_to_vllm_fits_vllms_own_fields`: exact mode over the
//!   vLLM wire (`exact.wire = "vllm"`) driven the same way; every `/v1/completions` body the
//!   scripted vLLM side received must hold only fields vLLM 0.34.0's `CompletionRequest`
//!   reads, of their types (vLLM ignores unknown fields silently, so an unknown one is a
//!   key graft thinks it sends and vLLM never reads), and its `structured_outputs` (response
//!   formats, the structural tags of tool calls under vLLM's default strict tool calling, the
//!   forced calls' JSON schemas without it) must pass vLLM's own `StructuredOutputsParams`
//!   and compile with xgrammar 0.2.8, as vLLM validates them; planted faults in one of those
//!   bodies are reported.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::conformance::{self, Sent};
use common::{Proc, TestEnv, http};
use serde_json::{Value, json};

const SCRIPT: &str = r#"{"rules": [
  {"role": "tool", "reply": {"content": "The directory holds a.txt and b.txt."}},
  {"match": "list the files", "reply": {"reasoning": "I need to look.", "content": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]}},
  {"match": "tell a long story", "reply": {"content": "Once upon a time there was a gateway that recorded every single token the policy sampled, and the researchers who trained on them never again wondered what the model had really seen."}}
]}"#;

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}])
}

struct Setup {
    gateway: Proc,
    upstream: Proc,
    _dir: tempfile::TempDir,
}

fn start() -> Setup {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let q = qwen3.to_str().unwrap();
    let upstream = Proc::scripted_upstream(&[
        "--script",
        script.to_str().unwrap(),
        "--tokenizer",
        q,
        "--chunk-delay-ms",
        "20",
    ]);
    let gateway = Proc::gateway_with(
        &upstream.url,
        &data,
        &["--mode", "exact", "--model-dir", q],
        &[],
    );
    Setup {
        gateway,
        upstream,
        _dir: dir,
    }
}

/// Every body the scripted SGLang side was sent (`GET /testkit/requests`, `bodies`).
async fn bodies_sent(upstream: &str) -> Vec<Sent> {
    let log = http::get(&format!("{upstream}/testkit/requests"), &[])
        .await
        .json();
    log["bodies"]
        .as_array()
        .unwrap_or_else(|| panic!("the scripted upstream keeps no bodies: {log}"))
        .iter()
        .map(|b| Sent::sglang(b["path"].as_str().unwrap(), b["body"].clone()))
        .collect()
}

/// A whole call in `dialect` (`chat` or `completions`) with `extra` merged into the body;
/// asserts it is answered.
async fn call(base: &str, dialect: &str, stream: bool, extra: Value) {
    let mut body = match dialect {
        "chat" => json!({"model": "qwen3", "stream": stream,
            "messages": [{"role": "user", "content": "tell a long story"}]}),
        _ => json!({"model": "qwen3", "stream": stream, "prompt": "tell a long story"}),
    };
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let path = if dialect == "chat" {
        "chat/completions"
    } else {
        "completions"
    };
    let r = http::post_json(&format!("{base}/{path}"), &[], &body).await;
    assert_eq!(r.status, 200, "{body} -> {}", r.text());
    if stream {
        assert_eq!(
            r.sse_data().last().map(String::as_str),
            Some("[DONE]"),
            "{}",
            r.text()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point10_every_body_graft_sends_to_sglang_fits_sglangs_own_models() {
    let servers = conformance::Servers::get();
    let s = start();
    let gw = s.gateway.url.clone();
    let (_sid, base) = common::open_session(&gw).await;

    // Every sampling key graft maps, in both dialects, whole and streamed.
    let sampling = [
        json!({}),
        json!({"temperature": 0.7, "top_p": 0.9, "max_tokens": 64}),
        json!({"top_k": 20, "min_p": 0.05, "seed": 7}),
        json!({"top_k": 0, "temperature": 0}),
        json!({"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1}),
        json!({"logit_bias": {"40": 2.5, "1079": -1}}),
        json!({"stop": ["gateway"], "max_tokens": 200}),
        json!({"stop": "END"}),
    ];
    for dialect in ["chat", "completions"] {
        for stream in [false, true] {
            for extra in &sampling {
                call(&base, dialect, stream, extra.clone()).await;
            }
        }
    }
    // Decode constraints: structured output, and a forced tool call (SGLang's structural
    // tag), each with `require_reasoning` (the default Qwen3 config thinks).
    for extra in [
        json!({"response_format": {"type": "json_object"}}),
        json!({"tools": tools(), "tool_choice": "required"}),
        json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "bash"}}}),
    ] {
        call(&base, "chat", false, extra).await;
    }
    // A tool loop.
    let mut messages = vec![json!({"role": "user", "content": "list the files please"})];
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &json!({"model": "qwen3", "messages": messages, "tools": tools(), "tool_choice": "auto"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let msg = r.json()["choices"][0]["message"].clone();
    let call_id = msg["tool_calls"][0]["id"].as_str().unwrap().to_owned();
    messages.push(msg);
    messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": "a.txt\nb.txt"}));
    call(
        &base,
        "chat",
        true,
        json!({"messages": messages, "tools": tools()}),
    )
    .await;
    // A stream the client abandons: graft tells the backend to stop it (`/abort_request`).
    let story = json!({"model": "qwen3", "stream": true,
        "messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": 200});
    let resp = http::post_stream(&format!("{base}/chat/completions"), &story).await;
    let mut body = resp.into_body();
    let mut buf = String::new();
    http::next_sse_data(&mut body, &mut buf).await.unwrap();
    drop(body);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !bodies_sent(&s.upstream.url)
        .await
        .iter()
        .any(|b| b.path == "/abort_request")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "graft did not abort the abandoned generation"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The trainer's weight push to an SGLang server.
    let up = s.upstream.url.clone();
    tokio::task::spawn_blocking(move || {
        graft_trainer::push::push_weights(&up, std::path::Path::new("/ckpt/step-1"), "step-1", None)
    })
    .await
    .unwrap()
    .unwrap();

    let sent = bodies_sent(&s.upstream.url).await;
    let verdicts = conformance::check(&servers, &sent);
    for path in [
        "/generate",
        "/abort_request",
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/continue_generation",
    ] {
        assert!(
            sent.iter().any(|b| b.path == path),
            "graft sent no {path}: {sent:#?}"
        );
    }
    let generates: Vec<&Sent> = sent.iter().filter(|b| b.path == "/generate").collect();
    assert!(generates.len() >= 34, "{}", generates.len());
    // Each key graft maps reached SGLang at least once.
    for key in [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_new_tokens",
        "stop",
        "sampling_seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "json_schema",
        "structural_tag",
    ] {
        assert!(
            generates
                .iter()
                .any(|b| b.body["sampling_params"].get(key).is_some()),
            "no /generate carried sampling_params.{key}"
        );
    }
    assert!(
        generates
            .iter()
            .any(|b| b.body["require_reasoning"] == json!(true)),
        "no /generate carried require_reasoning"
    );
    let bad: Vec<String> = verdicts
        .iter()
        .filter(|v| !v.ok)
        .map(|v| format!("{v}"))
        .collect();
    assert!(
        bad.is_empty(),
        "bodies SGLang 0.5.23 would refuse or ignore:\n{}",
        bad.join("\n")
    );

    // A planted unknown sampling key fails the same check, with SGLang's own message...
    let mut planted = generates[0].body.clone();
    planted["sampling_params"]["graft_bogus"] = json!(1);
    let v = conformance::check(&servers, &[Sent::sglang("/generate", planted.clone())]);
    assert!(!v[0].ok, "{}", v[0]);
    let sglang_says = v[0].errors[0].clone();
    assert!(
        sglang_says.starts_with("unknown field `graft_bogus`, expected one of"),
        "{sglang_says}"
    );
    // ... which is graft's list of SGLang's keys word for word (graft serve answers it too)...
    assert_eq!(
        graft_wire::sglang::sampling_params_contract_error(&planted).as_deref(),
        Some(sglang_says.as_str())
    );
    // ... and the scripted upstream answers it as SGLang does: 400 {"error": message}.
    let r = http::post_json(&format!("{}/generate", s.upstream.url), &[], &planted).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json(), json!({"error": sglang_says}));
}

#[tokio::test]
async fn point10_scripted_upstream_takes_tensor_updates_only_inside_a_weight_update_session() {
    let servers = conformance::Servers::get();
    let strings = servers.strings("sglang/srt/managers/scheduler_components/weight_updater.py");
    let up = Proc::scripted_upstream(&[]);
    let post = |path: &'static str, body: Value| {
        let url = format!("{}{path}", up.url);
        async move { http::post_json(&url, &[], &body).await }
    };
    let tensor = json!({"serialized_named_tensors": ["eA=="], "weight_version": "v2"});
    let refused = |r: &http::Resp| {
        assert_eq!(r.status, 400, "{}", r.text());
        let v = r.json();
        assert_eq!(v["success"], false, "{v}");
        let m = v["message"].as_str().unwrap().to_owned();
        assert!(
            strings.contains(&m),
            "{m:?} is not one of SGLang 0.5.23's own messages"
        );
        m
    };
    // Outside a session: refused, and the weights stay.
    let m = refused(&post("/update_weights_from_tensor", tensor.clone()).await);
    assert!(
        m.starts_with("update_weights_from_tensor must run between"),
        "{m}"
    );
    let info = http::get(&format!("{}/get_model_info", up.url), &[])
        .await
        .json();
    assert_eq!(info["weight_version"], "default", "{info}");
    let m = refused(&post("/end_weight_update", json!({})).await);
    assert!(m.starts_with("no weight-update session is open"), "{m}");
    // Inside one: taken.
    let r = post("/begin_weight_update", json!({})).await;
    assert_eq!(
        (r.status, r.json()["success"].clone()),
        (200, json!(true)),
        "{}",
        r.text()
    );
    let m = refused(&post("/begin_weight_update", json!({})).await);
    assert!(
        m.starts_with("a weight-update session is already open"),
        "{m}"
    );
    let r = post("/update_weights_from_tensor", tensor.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let info = http::get(&format!("{}/get_model_info", up.url), &[])
        .await
        .json();
    assert_eq!(info["weight_version"], "v2", "{info}");
    let r = post("/end_weight_update", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Closed again: refused again.
    refused(&post("/update_weights_from_tensor", tensor.clone()).await);
    // The bodies of this sequence are ones SGLang's models take.
    let log = http::get(&format!("{}/testkit/requests", up.url), &[])
        .await
        .json();
    let sent: Vec<Sent> = log["bodies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| Sent::sglang(b["path"].as_str().unwrap(), b["body"].clone()))
        .collect();
    assert_eq!(sent.len(), 7, "{log}");
    for v in conformance::check(&servers, &sent) {
        assert!(v.ok, "{v}");
    }
}

/// Every body the scripted vLLM side was sent (`GET /testkit/vllm/requests`).
async fn vllm_bodies_sent(upstream: &str) -> Vec<Sent> {
    let log = http::get(&format!("{upstream}/testkit/vllm/requests"), &[])
        .await
        .json();
    log["completions"]
        .as_array()
        .unwrap_or_else(|| panic!("the scripted vLLM side keeps no requests: {log}"))
        .iter()
        .map(|b| Sent::vllm("/v1/completions", b["body"].clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point10_every_body_graft_sends_to_vllm_fits_vllms_own_fields() {
    let servers = conformance::Servers::get();
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let q = qwen3.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let cfg = dir.path().join("graft.toml");
    std::fs::write(&cfg, "[exact]\nwire = \"vllm\"\n").unwrap();
    let upstream =
        Proc::scripted_upstream(&["--script", script.to_str().unwrap(), "--tokenizer", q]);
    let gateway = Proc::gateway_with(
        &upstream.url,
        &dir.path().join("data"),
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            cfg.to_str().unwrap(),
        ],
        &[],
    );
    let (_sid, base) = common::open_session(&gateway.url).await;
    let sampling = [
        json!({}),
        json!({"temperature": 0.7, "top_p": 0.9, "max_tokens": 64}),
        json!({"top_k": 20, "min_p": 0.05, "seed": 7}),
        json!({"top_k": 0, "temperature": 0}),
        json!({"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1}),
        json!({"logit_bias": {"40": 2.5, "1079": -1}}),
        json!({"stop": ["gateway"], "max_tokens": 200}),
        json!({"stop": "END"}),
    ];
    for dialect in ["chat", "completions"] {
        for stream in [false, true] {
            for extra in &sampling {
                call(&base, dialect, stream, extra.clone()).await;
            }
        }
    }
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &json!({"model": "qwen3", "tools": tools(),
            "messages": [{"role": "user", "content": "list the files please"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Decode constraints: structured output, and forced calls: structural tags in the
    // model's own syntax (VLLM_ENFORCE_STRICT_TOOL_CALLING, vLLM's default), the `required`
    // tag OR the response format under `auto` with a strict tool, one call without parallel
    // calls.
    let strict = json!([{"type": "function", "function": {"name": "bash", "strict": true,
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]);
    let schema = json!({"type": "json_schema", "json_schema": {"name": "answer",
        "schema": {"type": "object", "properties": {"answer": {"type": "string"}}}}});
    let constraints = [
        json!({"response_format": {"type": "json_object"}}),
        json!({"response_format": schema}),
        json!({"tools": tools(), "tool_choice": "required"}),
        json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "bash"}}}),
        json!({"tools": strict, "tool_choice": "auto", "response_format": schema}),
        json!({"tools": tools(), "tool_choice": "auto", "parallel_tool_calls": false}),
    ];
    for extra in &constraints {
        call(&base, "chat", false, extra.clone()).await;
    }
    // And with VLLM_ENFORCE_STRICT_TOOL_CALLING=0: the forced calls' JSON schemas.
    let loose_cfg = dir.path().join("loose.toml");
    std::fs::write(
        &loose_cfg,
        "[exact]\nwire = \"vllm\"\nvllm_strict_tool_calling = false\n",
    )
    .unwrap();
    let loose = Proc::gateway_with(
        &upstream.url,
        &dir.path().join("data-loose"),
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            loose_cfg.to_str().unwrap(),
        ],
        &[],
    );
    let (_sid, loose_base) = common::open_session(&loose.url).await;
    for extra in &constraints[2..4] {
        call(&loose_base, "chat", false, extra.clone()).await;
    }

    let sent = vllm_bodies_sent(&upstream.url).await;
    assert!(sent.len() >= 39, "{}", sent.len());
    let tags = sent
        .iter()
        .filter(|b| b.body["structured_outputs"].get("structural_tag").is_some())
        .count();
    assert_eq!(tags, 4, "required, named, auto OR format, one call");
    for key in [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "return_token_ids",
        "logprobs",
        "structured_outputs",
    ] {
        assert!(
            sent.iter().any(|b| b.body.get(key).is_some()),
            "no /v1/completions carried {key}"
        );
    }
    let bad: Vec<String> = conformance::check(&servers, &sent)
        .iter()
        .filter(|v| !v.ok)
        .map(|v| format!("{v}"))
        .collect();
    assert!(
        bad.is_empty(),
        "bodies vLLM 0.34.0 would refuse or silently ignore:\n{}",
        bad.join("\n")
    );

    // What vLLM would silently ignore, or refuse, in one of graft's own bodies, is reported.
    let real = sent[0].body.clone();
    let mut planted = real.clone();
    planted["graft_bogus"] = json!(1);
    let mut negative = real.clone();
    negative["prompt"] = json!([1, -2]);
    let mut typed = real.clone();
    typed["return_token_ids"] = json!("yes");
    // A structural tag xgrammar cannot compile, and two constraints at once.
    let tagged = sent
        .iter()
        .find(|b| b.body["structured_outputs"].get("structural_tag").is_some())
        .unwrap()
        .body
        .clone();
    let mut broken = tagged.clone();
    broken["structured_outputs"]["structural_tag"] = json!(
        tagged["structured_outputs"]["structural_tag"]
            .as_str()
            .unwrap()
            .replace("\"tags_with_separator\"", "\"tags_with_a_separator\"")
    );
    let mut two = tagged;
    two["structured_outputs"]["json_object"] = json!(true);
    let v = conformance::check(
        &servers,
        &[
            Sent::vllm("/v1/completions", planted),
            Sent::vllm("/v1/completions", negative),
            Sent::vllm("/v1/completions", typed),
            Sent::vllm("/v1/no_such_route", json!({})),
            Sent::vllm("/v1/completions", broken),
            Sent::vllm("/v1/completions", two),
        ],
    );
    assert!(v.iter().all(|v| !v.ok), "{v:#?}");
    assert!(v[0].errors[0].contains("`graft_bogus` is not a field of vllm's CompletionRequest"));
    assert!(v[1].errors[0].starts_with("prompt:"), "{}", v[1]);
    assert!(v[2].errors[0].starts_with("return_token_ids:"), "{}", v[2]);
    assert!(v[3].errors[0].contains("serves no POST"), "{}", v[3]);
    assert!(
        v[4].errors[0].contains("xgrammar") && v[4].errors[0].contains("tags_with_a_separator"),
        "{}",
        v[4]
    );
    assert!(v[5].errors[0].contains("only use one kind"), "{}", v[5]);
}
