//! `graft demo`: the embedded default. Starts the scripted upstream, puts the gateway in
//! front of it with a local data dir, runs a short two-turn agent conversation through a
//! session (streamed tool call, then a tool result and a final answer), posts a reward,
//! closes the session, and prints where the records went.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use graft_gateway::dialect::chat::Assembler;
use graft_gateway::sse::Splitter;
use graft_gateway::{FileConfig, Gateway, GatewayConfig, Overrides};
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Where the gateway writes its records.
    #[arg(long, default_value = "graft-data")]
    pub data_dir: PathBuf,
}

const SCRIPT: &str = r#"{
  "rules": [
    {"match": "18 degrees", "reply": {"content": "It is 18 degrees and sunny in Lisbon: a good day for a walk."}},
    {"match": "weather", "reply": {"content": "Let me check the weather.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lisbon"}}]}}
  ]
}"#;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!("graft-demo-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let script = tmp.join("script.json");
    std::fs::write(&script, SCRIPT)?;

    // 1. The scripted upstream, as its own process (it stands in for the model server).
    let exe = std::env::current_exe()?;
    let mut upstream = tokio::process::Command::new(exe)
        .args(["scripted-upstream", "--listen", "127.0.0.1:0", "--script"])
        .arg(&script)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the scripted upstream")?;
    let stdout = upstream
        .stdout
        .take()
        .context("no stdout from the scripted upstream")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .context("the scripted upstream did not start within 20 s")??
        .context("the scripted upstream exited before listening")?;
    let upstream_url = line
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("http"))
        .with_context(|| format!("unexpected line from the scripted upstream: {line}"))?
        .to_string();
    println!("scripted upstream   {upstream_url}");

    // 2. The gateway in front of it, recording into the data dir.
    let cfg = GatewayConfig::resolve(
        FileConfig::default(),
        Overrides {
            listen: Some(([127, 0, 0, 1], 0).into()),
            upstream: Some(upstream_url),
            data_dir: Some(args.data_dir.clone()),
            durability: None,
            ..Default::default()
        },
    )?;
    let gw = Gateway::bind(cfg).await?;
    let gateway_url = gw.url();
    // The session API takes the admin key the gateway generated into the data dir.
    let admin = gw.admin_key().map(str::to_string);
    println!(
        "graft gateway       {gateway_url}  (records in {})",
        args.data_dir.display()
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(gw.serve(async {
        let _ = stop_rx.await;
    }));

    // 3. A short client run through a session.
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let result = conversation(&client, &gateway_url, admin.as_deref()).await;
    let _ = stop_tx.send(());
    serving.await??;
    let _ = upstream.kill().await;
    let _ = std::fs::remove_dir_all(&tmp);
    let session_id = result?;

    // 4. Where the records went.
    let records = graft_recorder::read_records(&args.data_dir)?;
    let mine: Vec<_> = records
        .iter()
        .filter(|r| r.session_id == session_id)
        .collect();
    println!();
    println!("recorded {} calls for session {session_id}:", mine.len());
    for r in &mine {
        println!(
            "  #{} {} {} status {} {} finish={} latency {:.1} ms",
            r.seq,
            r.endpoint,
            if r.stream { "sse " } else { "json" },
            r.status,
            r.outcome,
            r.finish_reason.as_deref().unwrap_or("-"),
            r.latency_ms
        );
    }
    let mut files = vec![];
    collect_parquet(&args.data_dir, &mut files);
    files.sort();
    println!("Parquet segments (read them with pyarrow, polars or DuckDB):");
    for f in &files {
        println!("  {}", f.display());
    }
    println!();
    println!("next:");
    println!(
        "  graft records sessions --data-dir {}",
        args.data_dir.display()
    );
    println!(
        "  graft records show --data-dir {} --session {session_id} --json",
        args.data_dir.display()
    );
    println!(
        "  graft records export --data-dir {} --format parquet --out calls.parquet",
        args.data_dir.display()
    );
    Ok(())
}

fn collect_parquet(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_parquet(&p, out);
        } else if p.extension().is_some_and(|x| x == "parquet") {
            out.push(p);
        }
    }
}

async fn post(
    client: &HttpClient,
    url: &str,
    key: Option<&str>,
    body: &Value,
) -> anyhow::Result<(u16, Bytes)> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let resp = client
        .request(req.body(Full::new(Bytes::from(body.to_string())))?)
        .await?;
    let status = resp.status().as_u16();
    Ok((status, resp.into_body().collect().await?.to_bytes()))
}

async fn conversation(
    client: &HttpClient,
    gateway: &str,
    admin: Option<&str>,
) -> anyhow::Result<String> {
    let (status, body) = post(
        client,
        &format!("{gateway}/graft/sessions"),
        admin,
        &json!({"group_id": "demo"}),
    )
    .await?;
    if status != 201 {
        bail!(
            "creating a session failed: HTTP {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let s: Value = serde_json::from_slice(&body)?;
    let session_id = s["session_id"]
        .as_str()
        .context("no session_id")?
        .to_string();
    let base = s["base_url"].as_str().context("no base_url")?.to_string();
    let key = s["api_key"].as_str().context("no api_key")?.to_string();
    println!("session             {session_id}  base_url {base}");
    println!();

    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let mut messages = vec![
        json!({"role": "system", "content": "You are a helpful assistant."}),
        json!({"role": "user", "content": "What is the weather in Lisbon?"}),
    ];
    println!("user      What is the weather in Lisbon?");

    // Turn 1, streamed: the answer arrives event by event, with a tool call.
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("{base}/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Full::new(Bytes::from(
            json!({"model": "demo-model", "messages": messages, "tools": tools, "stream": true,
                   "stream_options": {"include_usage": true}})
            .to_string(),
        )))?;
    let resp = client.request(req).await?;
    if !resp.status().is_success() {
        bail!("turn 1 failed: HTTP {}", resp.status());
    }
    let mut body = resp.into_body();
    let mut splitter = Splitter::default();
    let mut asm = Assembler::chat();
    print!("assistant ");
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        splitter.push(&data);
        while let Some(ev) = splitter.next_event(1 << 24)? {
            if ev.is_done() {
                continue;
            }
            if let Some(d) = ev.data {
                let v: Value = serde_json::from_str(&d)?;
                if let Some(t) = v
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                {
                    print!("{t}");
                }
                asm.push(&v);
            }
        }
    }
    println!();
    let answer = asm.finish();
    let msg = answer["choices"][0]["message"].clone();
    let call = msg["tool_calls"][0].clone();
    println!(
        "  tool call {}({})",
        call["function"]["name"].as_str().unwrap_or("?"),
        call["function"]["arguments"].as_str().unwrap_or("")
    );
    messages.push(msg);
    messages
        .push(json!({"role": "tool", "tool_call_id": call["id"], "content": "18 degrees, sunny"}));
    println!("tool      18 degrees, sunny");

    // Turn 2, JSON: the history grows; the recorder stores only what was added.
    let (status, body) = post(
        client,
        &format!("{base}/chat/completions"),
        Some(&key),
        &json!({"model": "demo-model", "messages": messages, "tools": tools}),
    )
    .await?;
    if status != 200 {
        bail!(
            "turn 2 failed: HTTP {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let v: Value = serde_json::from_slice(&body)?;
    println!(
        "assistant {}",
        v["choices"][0]["message"]["content"].as_str().unwrap_or("")
    );

    let (status, _) = post(
        client,
        &format!("{gateway}/graft/sessions/{session_id}/reward"),
        admin,
        &json!({"reward": 1.0}),
    )
    .await?;
    anyhow::ensure!(status == 200, "posting the reward failed: HTTP {status}");
    let (status, _) = post(
        client,
        &format!("{gateway}/graft/sessions/{session_id}/close"),
        admin,
        &json!({}),
    )
    .await?;
    anyhow::ensure!(status == 200, "closing the session failed: HTTP {status}");
    println!("reward    1.0 posted, session closed");
    Ok(session_id)
}
